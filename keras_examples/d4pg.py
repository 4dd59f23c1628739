"""D4PG on Pendulum-v1 or a DeepMind Control Suite task: actors, a replay
buffer, a replicated learner.

The paper's third workload: Distributed Distributional DDPG (Barth-Maron et
al., 2018). A deterministic actor and a distributional critic (a categorical
distribution over a fixed support of returns, trained on the projected
n-step Bellman target); target networks that trail the online ones; a
small penalty on the actor's pre-tanh output, without which it saturates
(a bang-bang policy that stops learning). Actors play episodes with
exploration noise, evaluating the policy with a NumPy forward pass (no
TensorFlow call per environment step), and fill a replay buffer with n-step
transitions. The learner draws a global batch, each replica takes its
slice, and updates both networks with `strategy.run`, several updates per
`tf.function` call. The result is the average return of the noise-free
policy.

`--env` picks the environment: Gymnasium's Pendulum-v1 (200 steps an
episode; random play scores about -1200, a good policy about -150) or a
Control Suite task named domain-task, such as cartpole-swingup (1000 steps
an episode, rewards in [0, 1]; the observations, a dict, are flattened).

Across workers, every worker runs its own actors and buffer (seeded apart)
and its replicas learn from it; the networks stay identical everywhere.

  python keras_examples/d4pg.py --replicas 4
  python keras_examples/d4pg.py --env cartpole-swingup --iterations 20 \\
      --updates 1000 --replicas 4
  replicator-launch --workers 2 -- \\
      python keras_examples/d4pg.py --replicas 2 --quick
"""

import harness  # pylint: disable=g-bad-import-order  (nothing heavy)


PENDULUM = "Pendulum-v1"
NUM_ATOMS = 101


def add_arguments(parser):
  parser.add_argument("--env", default=PENDULUM,
                      help=f"{PENDULUM} (Gymnasium's) or a DeepMind Control "
                      "Suite task as domain-task, e.g. cartpole-swingup "
                      f"(default: {PENDULUM})")
  parser.add_argument("--iterations", type=int, default=20,
                      help="rounds of acting (one episode per actor) and "
                      "learning (default: 20)")
  parser.add_argument("--actors", type=int, default=4,
                      help="environments per worker, stepped together "
                      "(default: 4)")
  parser.add_argument("--updates", type=int, default=400,
                      help="learner updates per iteration (default: 400)")
  parser.add_argument("--updates-per-call", type=int, default=20,
                      help="learner updates in one tf.function call "
                      "(default: 20)")
  parser.add_argument("--global-batch-size", type=int, default=256,
                      help="transitions per update over all replicas "
                      "(default: 256)")
  parser.add_argument("--n-step", type=int, default=5,
                      help="rewards summed before bootstrapping (default: 5)")
  parser.add_argument("--discount", type=float, default=0.99,
                      help="per-step discount of future rewards "
                      "(default: 0.99)")
  parser.add_argument("--noise", type=float, default=0.3,
                      help="exploration noise's standard deviation, in "
                      "units of the largest action (default: 0.3)")
  parser.add_argument("--critic-learning-rate", type=float, default=1e-3,
                      help="Adam's learning rate for the critic "
                      "(default: 1e-3)")
  parser.add_argument("--actor-learning-rate", type=float, default=1e-4,
                      help="Adam's learning rate for the actor "
                      "(default: 1e-4)")
  parser.add_argument("--saturation-penalty", type=float, default=1e-3,
                      help="weight of the squared pre-tanh action in the "
                      "actor's loss, which pulls a saturated actor back "
                      "(default: 0.001)")
  parser.add_argument("--target-update-rate", type=float, default=0.005,
                      help="how far target networks move toward the online "
                      "ones per update (default: 0.005)")
  parser.add_argument("--eval-episodes", type=int, default=10,
                      help="noise-free episodes that give the average return "
                      "at the end (default: 10)")


if __name__ == "__main__":
  # --help and a bad flag answer here, before TensorFlow loads.
  harness.read_command_line(__doc__, add_arguments)

import os

import keras
import numpy as np
import tensorflow as tf


def torso(inputs, width):
  """Acme's layer-norm torso: Dense, LayerNorm, tanh, then two elu layers.

  The normalized first layer keeps the features bounded however large the
  observations (a pole's angular velocity reaches 20).
  """
  h = keras.layers.Dense(width)(inputs)
  h = keras.layers.LayerNormalization()(h)
  h = keras.layers.Activation("tanh")(h)
  h = keras.layers.Dense(width, activation="elu")(h)
  return keras.layers.Dense(width, activation="elu")(h)


def build_actor(obs_dim, action_dim):
  """Observation -> action in [-1, 1] (scaled to the action bounds).

  The last layer starts near zero (Acme's D4PG), so the first actions are
  small and the critic's gradient moves them from there.
  """
  obs = keras.Input((obs_dim,))
  pre_tanh = keras.layers.Dense(
      action_dim, kernel_initializer=keras.initializers.VarianceScaling(1e-4))(
          torso(obs, 256))
  return keras.Model(obs, keras.layers.Activation("tanh")(pre_tanh),
                     name="actor")


def build_critic(obs_dim, action_dim):
  """(observation, action) -> logits of the return's distribution."""
  obs = keras.Input((obs_dim,))
  action = keras.Input((action_dim,))
  h = torso(keras.layers.Concatenate()([obs, action]), 256)
  return keras.Model([obs, action], keras.layers.Dense(NUM_ATOMS)(h),
                     name="critic")


def numpy_policy(actor):
  """The actor as a NumPy function of a batch of observations.

  Actors step their environments with it: no TensorFlow call per step.
  """
  activations = {"tanh": np.tanh, "linear": lambda x: x,
                 "elu": lambda x: np.where(x > 0, x, np.expm1(x))}
  steps = []
  for layer in actor.layers:
    if isinstance(layer, keras.layers.Dense):
      kernel, bias = np.asarray(layer.kernel), np.asarray(layer.bias)
      steps.append(lambda h, k=kernel, b=bias: h @ k + b)
      steps.append(activations[keras.activations.serialize(
          layer.activation)])
    elif isinstance(layer, keras.layers.LayerNormalization):
      gamma, beta = np.asarray(layer.gamma), np.asarray(layer.beta)
      steps.append(lambda h, g=gamma, b=beta, e=layer.epsilon: (
          h - h.mean(-1, keepdims=True)) / np.sqrt(
              h.var(-1, keepdims=True) + e) * g + b)
    elif isinstance(layer, keras.layers.Activation):
      steps.append(activations[keras.activations.serialize(
          layer.activation)])

  def policy(observations):
    h = observations
    for step in steps:
      h = step(h)
    return h

  return policy


def project(target_atoms, probabilities, atoms):
  """Projects a distribution on `target_atoms` onto the fixed `atoms`.

  Each target atom's mass goes to its two neighbours on the support, in
  proportion to closeness (the categorical projection of C51 and D4PG);
  targets beyond the support land on its ends.
  """
  spacing = atoms[1] - atoms[0]
  clipped = tf.clip_by_value(target_atoms, atoms[0], atoms[-1])
  # weight[b, i, j]: the share of target atom j that goes to atom i.
  weight = tf.clip_by_value(
      1.0 - tf.abs(clipped[:, None, :] - atoms[None, :, None]) / spacing,
      0.0, 1.0)
  return tf.reduce_sum(weight * probabilities[:, None, :], axis=-1)


def n_step_transitions(observations, actions, rewards, n, discount):
  """An episode's n-step transitions, for episodes that end by time limit.

  `observations` is [T + 1, actors, obs_dim], `actions` [T, actors, ...],
  `rewards` [T, actors]. Step t's return sums the next min(n, T - t)
  rewards; it bootstraps from the observation after them with that power
  of the discount (a time limit is not a terminal state).
  """
  steps = len(rewards)
  padded = np.concatenate([rewards, np.zeros((n,) + rewards.shape[1:])])
  returns = sum(discount**i * padded[i:i + steps] for i in range(n))
  ahead = np.minimum(np.arange(steps) + n, steps)
  discounts = discount**(ahead - np.arange(steps))

  def flat(x):
    return x.reshape((-1,) + x.shape[2:]).astype("float32")

  return (flat(observations[:-1]), flat(actions), flat(returns),
          flat(np.broadcast_to(discounts[:, None], rewards.shape)),
          flat(observations[ahead]))


class ReplayBuffer:
  """A ring buffer of (obs, action, n-step return, discount, next obs)."""

  def __init__(self, capacity, seed):
    self.capacity = capacity
    self.fields = None
    self.size = self.next = 0
    self.rng = np.random.default_rng(seed)

  def add(self, transitions):
    if self.fields is None:
      self.fields = [np.zeros((self.capacity,) + t.shape[1:], t.dtype)
                     for t in transitions]
    rows = (self.next + np.arange(len(transitions[0]))) % self.capacity
    for field, values in zip(self.fields, transitions):
      field[rows] = values
    self.next = (rows[-1] + 1) % self.capacity
    self.size = min(self.size + len(rows), self.capacity)

  def sample(self, *shape):
    rows = self.rng.integers(0, self.size, shape)
    return tuple(field[rows] for field in self.fields)


class GymnasiumPendulum:
  """Gymnasium's Pendulum-v1; actions in [-1, 1], scaled to its torque."""

  def __init__(self):
    import gymnasium  # pylint: disable=g-import-not-at-top
    self.env = gymnasium.make(PENDULUM)
    self.scale = self.env.action_space.high
    self.observation_size = self.env.observation_space.shape[0]
    self.action_size = self.env.action_space.shape[0]

  def support(self, discount):
    """The critic's range of returns: rewards lie in [-16.3, 0], and from
    -1000 on covers what a learning policy meets at discount 0.99."""
    del discount
    return -1000.0, 0.0

  def reset(self, seed):
    return self.env.reset(seed=seed)[0]

  def step(self, action):
    """(observation, reward, whether the episode ended)."""
    observation, reward, terminated, truncated, _ = self.env.step(
        action * self.scale)
    return observation, reward, terminated or truncated


class ControlSuiteTask:
  """A DeepMind Control Suite task ("cartpole-swingup"); actions in [-1, 1],
  scaled to its bounds, and its observation dict flattened to one vector.

  The suite's tasks end by time limit, and their rewards lie in [0, 1].
  """

  def __init__(self, name):
    os.environ.setdefault("MUJOCO_GL", "disable")  # No rendering here.
    from dm_control import suite  # pylint: disable=g-import-not-at-top
    domain, _, task = name.partition("-")
    if (domain, task) not in suite.ALL_TASKS:
      raise ValueError(
          f"Expected --env to be {PENDULUM} or a Control Suite task as "
          f"domain-task (e.g. cartpole-swingup). Received: --env {name}. "
          f"The suite's tasks: " + ", ".join(
              f"{d}-{t}" for d, t in suite.ALL_TASKS))
    self.env = suite.load(domain, task)
    spec = self.env.action_spec()
    self.low, self.high = spec.minimum, spec.maximum
    self.action_size = spec.shape[0]
    self.observation_size = sum(
        int(np.prod(s.shape)) for s in self.env.observation_spec().values())

  def support(self, discount):
    """Returns of rewards in [0, 1] lie in [0, 1 / (1 - discount)]."""
    return 0.0, 1.0 / (1.0 - discount)

  def reset(self, seed):
    self.env.task.random.seed(seed)
    return _flat(self.env.reset().observation)

  def step(self, action):
    """(observation, reward, whether the episode ended)."""
    step = self.env.step(self.low + (action + 1.0) / 2.0 * (
        self.high - self.low))
    return _flat(step.observation), step.reward, step.last()


def _flat(observation):
  """A Control Suite observation dict as one vector, in the dict's order."""
  return np.concatenate([np.ravel(v) for v in observation.values()])


def make_environment(name):
  return GymnasiumPendulum() if name == PENDULUM else ControlSuiteTask(name)


class Actors:
  """`count` environments stepped together by one NumPy policy evaluation."""

  def __init__(self, env_name, count, seed):
    self.envs = [make_environment(env_name) for _ in range(count)]
    self.seed = seed
    self.rng = np.random.default_rng(seed)

  def play(self, actor, noise):
    """One episode on every environment; returns the arrays and returns."""
    policy = numpy_policy(actor)
    obs = np.stack([env.reset(self.seed + i)
                    for i, env in enumerate(self.envs)])
    self.seed += len(self.envs)
    observations, actions, rewards = [obs], [], []
    done = False
    while not done:
      mean = policy(obs)
      action = np.clip(
          mean + noise * self.rng.standard_normal(mean.shape), -1, 1)
      steps = [env.step(a) for env, a in zip(self.envs, action)]
      obs = np.stack([s[0] for s in steps])
      observations.append(obs)
      actions.append(action)
      rewards.append([s[1] for s in steps])
      done = any(s[2] for s in steps)
    rewards = np.array(rewards)
    return (np.array(observations), np.array(actions), rewards,
            rewards.sum(axis=0))


class Learner:
  """The networks, their targets and optimizers; `update` runs replicated."""

  def __init__(self, strategy, obs_dim, action_dim, support, args):
    self.strategy = strategy
    self.args = args
    with strategy.scope():
      self.actor = build_actor(obs_dim, action_dim)
      self.critic = build_critic(obs_dim, action_dim)
      self.target_actor = build_actor(obs_dim, action_dim)
      self.target_critic = build_critic(obs_dim, action_dim)
      self.actor_optimizer = keras.optimizers.Adam(args.actor_learning_rate)
      self.critic_optimizer = keras.optimizers.Adam(
          args.critic_learning_rate)
    # The actor up to its tanh, with the same weights.
    self.actor_pre_tanh = keras.Model(self.actor.inputs,
                                      self.actor.layers[-1].input)
    self.target_actor.set_weights(self.actor.get_weights())
    self.target_critic.set_weights(self.critic.get_weights())
    self.atoms = tf.constant(np.linspace(*support, NUM_ATOMS), tf.float32)

  def replica_update(self, obs, action, returns, discount, next_obs):
    """One update of critic and actor on this replica's transitions."""
    next_logits = self.target_critic(
        [next_obs, self.target_actor(next_obs)])
    target = project(returns[:, None] + discount[:, None] * self.atoms,
                     tf.nn.softmax(next_logits), self.atoms)
    with tf.GradientTape() as tape:
      critic_losses = tf.nn.softmax_cross_entropy_with_logits(
          tf.stop_gradient(target), self.critic([obs, action]))
      critic_loss = tf.nn.compute_average_loss(critic_losses)
    weights = self.critic.trainable_weights
    self.critic_optimizer.apply_gradients(
        zip(tape.gradient(critic_loss, weights), weights))

    with tf.GradientTape() as tape:
      pre_tanh = self.actor_pre_tanh(obs)
      probabilities = tf.nn.softmax(self.critic([obs, tf.tanh(pre_tanh)]))
      values = tf.reduce_sum(probabilities * self.atoms, axis=-1)
      actor_loss = tf.nn.compute_average_loss(
          -values + self.args.saturation_penalty * tf.reduce_sum(
              tf.square(pre_tanh), axis=-1))
    weights = self.actor.trainable_weights
    self.actor_optimizer.apply_gradients(
        zip(tape.gradient(actor_loss, weights), weights))
    return tf.reduce_mean(critic_losses), tf.reduce_mean(values)

  @tf.function
  def update(self, batches):
    """`updates_per_call` updates; each replica's batches are [K, b, ...]."""
    rate = self.args.target_update_rate
    critic_loss_sum = value_sum = 0.0
    for k in tf.range(self.args.updates_per_call):
      critic_loss, value = self.strategy.run(
          lambda k, *batch: self.replica_update(*(t[k] for t in batch)),
          args=(k,) + batches)
      critic_loss_sum += self.strategy.reduce("mean", critic_loss, None)
      value_sum += self.strategy.reduce("mean", value, None)
      for online, target in ((self.actor, self.target_actor),
                             (self.critic, self.target_critic)):
        for w, t in zip(online.weights, target.weights):
          t.assign(t + rate * (w - t))
    return (critic_loss_sum / self.args.updates_per_call,
            value_sum / self.args.updates_per_call)

  def sample_batches(self, buffer):
    """Each replica's [updates_per_call, batch / replicas, ...] samples.

    The global batch is drawn once and each replica takes its slice, so
    every update sees the same transitions whatever the replica count.
    """
    per_replica = self.args.global_batch_size // (
        self.strategy.num_replicas_in_sync)
    batches = buffer.sample(self.args.updates_per_call,
                            self.args.global_batch_size)

    def replica_slice(context):
      start = context.replica_id_in_sync_group * per_replica
      return tuple(tf.constant(t[:, start:start + per_replica])
                   for t in batches)

    return self.strategy.experimental_distribute_values_from_function(
        replica_slice)


def evaluate(actors, actor, episodes):
  """The average return of the noise-free policy over `episodes` episodes."""
  returns = []
  while len(returns) < episodes:
    returns.extend(actors.play(actor, noise=0.0)[3])
  return float(np.mean(returns[:episodes]))


def main():
  run = harness.start("d4pg", __doc__, add_arguments, quick={
      "iterations": 2, "updates": 40, "eval_episodes": 2})
  args = run.args
  strategy = run.strategy
  if args.global_batch_size % strategy.num_replicas_in_sync:
    raise ValueError(
        f"--global-batch-size {args.global_batch_size} must divide evenly "
        f"over the {strategy.num_replicas_in_sync} replicas.")
  if args.updates % args.updates_per_call:
    raise ValueError(
        f"--updates {args.updates} must be a multiple of --updates-per-call "
        f"{args.updates_per_call}.")
  # Each worker's actors and buffer are seeded apart; the networks are not.
  seed = 1000 * strategy.extended.first_replica_id
  actors = Actors(args.env, args.actors, seed)
  buffer = ReplayBuffer(100_000, seed)
  env = actors.envs[0]
  learner = Learner(strategy, env.observation_size, env.action_size,
                    env.support(args.discount), args)

  curves = {"training return": [], "critic loss": [], "mean value": []}
  for iteration in range(1, args.iterations + 1):
    observations, actions, rewards, returns = actors.play(
        learner.actor, args.noise)
    buffer.add(n_step_transitions(observations, actions, rewards,
                                  args.n_step, args.discount))
    losses = [learner.update(learner.sample_batches(buffer))
              for _ in range(args.updates // args.updates_per_call)]
    critic_loss, value = np.mean(np.array(losses, dtype=float), axis=0)
    for name, number in zip(curves, (np.mean(returns), critic_loss, value)):
      curves[name].append(float(number))
    run.log("iteration", iteration, curves)

  average_return = evaluate(Actors(args.env, args.actors, seed + 10**6),
                            learner.actor, args.eval_episodes)
  run.plot_curves("curves.png", {
      name: {name: values} for name, values in curves.items()},
      x_label="iteration", title=(
          f"D4PG on {args.env}, {run.replicas}, {args.actors} actors per "
          f"worker"))
  print(f"average return over {args.eval_episodes} episodes: "
        f"{average_return:.1f}")
  run.finish()


if __name__ == "__main__":
  main()
