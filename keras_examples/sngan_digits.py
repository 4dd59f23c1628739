"""A class-conditional SN-GAN on digits, with Keras `fit` or a custom loop.

The paper's second workload scaled down to scikit-learn's 8x8 digits: a
generator with cross-replica (synchronized) batch norm, a projection
discriminator whose layers are spectrally normalized
(`keras.layers.SpectralNormalization`), the hinge loss, and two models with
two optimizers updated in one step. The step is one function; `--loop fit`
calls it from a `keras.Model.train_step` (Keras `fit`), `--loop custom` from
`strategy.run` in a `tf.function`. Every interval the generated digits are
scored by a classifier trained on the real ones (the fraction classified as
the class they were generated for); at the end a grid of samples, one row
per class, is written as a PNG.

  python keras_examples/sngan_digits.py --replicas 4
  python keras_examples/sngan_digits.py --replicas 4 --loop custom
  replicator-launch --workers 2 -- \\
      python keras_examples/sngan_digits.py --replicas 2 --quick
"""

import harness  # pylint: disable=g-bad-import-order  (nothing heavy)


NOISE_DIM = 32
NUM_CLASSES = 10
SAMPLES_PER_CLASS = 100  # generated per class to score the generator


def add_arguments(parser):
  parser.add_argument("--loop", choices=("fit", "custom"), default="fit",
                      help="Keras fit with a custom train_step, or a custom "
                      "loop around strategy.run (default: fit)")
  parser.add_argument("--steps", type=int, default=2000,
                      help="training steps, one discriminator and one "
                      "generator update each (default: 2000)")
  parser.add_argument("--interval", type=int, default=200,
                      help="steps between progress lines and scores "
                      "(default: 200)")
  parser.add_argument("--global-batch-size", type=int, default=64,
                      help="real examples per step over all replicas "
                      "(default: 64)")
  parser.add_argument("--learning-rate", type=float, default=2e-4,
                      help="Adam's learning rate for both models "
                      "(default: 2e-4)")


if __name__ == "__main__":
  # --help and a bad flag answer here, before TensorFlow loads.
  harness.read_command_line(__doc__, add_arguments)

import digits
import keras
import numpy as np
from sklearn import svm
import tensorflow as tf


def build_generator():
  """(noise, class) -> an 8x8x1 image in [-1, 1]; batch norm across replicas."""
  noise = keras.Input((NOISE_DIM,))
  label = keras.Input((), dtype="int32")
  h = keras.layers.Concatenate()(
      [noise, keras.layers.Embedding(NUM_CLASSES, NOISE_DIM)(label)])
  h = keras.layers.Dense(4 * 4 * 128, use_bias=False)(h)
  h = keras.layers.BatchNormalization(synchronized=True)(h)
  h = keras.layers.Reshape((4, 4, 128))(keras.layers.ReLU()(h))
  h = keras.layers.UpSampling2D()(h)
  h = keras.layers.Conv2D(64, 3, padding="same", use_bias=False)(h)
  h = keras.layers.BatchNormalization(synchronized=True)(h)
  h = keras.layers.ReLU()(h)
  image = keras.layers.Conv2D(1, 3, padding="same", activation="tanh")(h)
  return keras.Model([noise, label], image, name="generator")


def build_discriminator():
  """(image, class) -> a real/fake score: a projection discriminator.

  The score is psi(h) + <embed(class), h> for image features h (Miyato and
  Koyama, 2018); every weight is spectrally normalized. The class embedding
  is a bias-free Dense layer on the one-hot class: Keras 3.15's
  SpectralNormalization casts an Embedding's output to the dtype of its
  integer input, which leaves the embedding without a gradient.
  """
  sn = keras.layers.SpectralNormalization
  image = keras.Input((8, 8, 1))
  label = keras.Input((), dtype="int32")
  h = image
  for filters, stride in ((64, 1), (128, 2), (256, 2)):  # 8x8 -> 2x2
    h = sn(keras.layers.Conv2D(filters, 3, stride, padding="same"))(h)
    h = keras.layers.LeakyReLU(0.1)(h)
  features = keras.layers.GlobalAveragePooling2D()(h)
  one_hot = keras.layers.CategoryEncoding(NUM_CLASSES, "one_hot")(label)
  embedded = sn(keras.layers.Dense(256, use_bias=False))(one_hot)
  projection = keras.layers.Dot(axes=1)([embedded, features])
  score = keras.layers.Add()([sn(keras.layers.Dense(1))(features), projection])
  return keras.Model([image, label], score, name="discriminator")


class ConditionalGAN(keras.Model):
  """The two models and their optimizers; `train_step` for Keras `fit`."""

  def __init__(self, generator, discriminator):
    super().__init__()
    self.generator = generator
    self.discriminator = discriminator
    self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
    self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

  def compile(self, d_optimizer, g_optimizer):  # pylint: disable=arguments-differ
    super().compile()
    self.d_optimizer = d_optimizer
    self.g_optimizer = g_optimizer

  @property
  def metrics(self):
    return [self.d_loss_tracker, self.g_loss_tracker]

  def replica_step(self, images, labels):
    """One hinge-loss update of each model on this replica's examples.

    Runs in a replica context (Keras's train_step, or `strategy.run`). The
    losses are scaled to this replica's share of the global mean, so the
    optimizers' sum over replicas is the gradient of the global mean.
    Returns this replica's mean (unscaled) discriminator and generator loss.
    """
    batch = tf.shape(labels)[0]
    noise = tf.random.normal((batch, NOISE_DIM))
    with tf.GradientTape() as tape:
      fakes = self.generator([noise, labels], training=True)
      real_scores = self.discriminator([images, labels], training=True)
      fake_scores = self.discriminator([fakes, labels], training=True)
      d_losses = (tf.nn.relu(1.0 - real_scores[:, 0]) +
                  tf.nn.relu(1.0 + fake_scores[:, 0]))
      d_loss = tf.nn.compute_average_loss(d_losses)
    weights = self.discriminator.trainable_weights
    self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, weights),
                                         weights))

    noise = tf.random.normal((batch, NOISE_DIM))
    with tf.GradientTape() as tape:
      fakes = self.generator([noise, labels], training=True)
      g_losses = -self.discriminator([fakes, labels], training=False)[:, 0]
      g_loss = tf.nn.compute_average_loss(g_losses)
    weights = self.generator.trainable_weights
    self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, weights),
                                         weights))
    return tf.reduce_mean(d_losses), tf.reduce_mean(g_losses)

  def train_step(self, data):
    images, labels = data
    d_loss, g_loss = self.replica_step(images, labels)
    self.d_loss_tracker.update_state(d_loss)
    self.g_loss_tracker.update_state(g_loss)
    return self.get_metrics_result()  # global values across replicas


class GeneratorScore:
  """Scores generated digits with an SVM trained on the real training set."""

  def __init__(self, x_train, y_train):
    self.classifier = svm.SVC(gamma="scale").fit(
        x_train.reshape(len(x_train), -1), y_train)
    rng = np.random.default_rng(0)
    self.labels = np.repeat(np.arange(NUM_CLASSES), SAMPLES_PER_CLASS)
    self.noise = rng.standard_normal(
        (len(self.labels), NOISE_DIM)).astype("float32")

  def generate(self, generator):
    """Images in [0, 1] for `self.labels`, as the real digits are scaled."""
    images = generator([self.noise, self.labels], training=False)
    return (np.asarray(images) + 1.0) / 2.0

  def __call__(self, generator):
    """The fraction of generated digits classified as their intended class."""
    images = self.generate(generator)
    predicted = self.classifier.predict(images.reshape(len(images), -1))
    return float(np.mean(predicted == self.labels))

  def write_grid(self, generator, path, columns=10):
    """A PNG with one row of `columns` samples per class."""
    images = self.generate(generator)[..., 0].reshape(
        NUM_CLASSES, SAMPLES_PER_CLASS, 8, 8)[:, :columns]
    padded = np.pad(images, ((0, 0), (0, 0), (1, 1), (1, 1)),
                    constant_values=0.5)
    grid = padded.transpose(0, 2, 1, 3).reshape(NUM_CLASSES * 10, columns * 10)
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    pyplot.imsave(path, np.kron(1.0 - grid, np.ones((4, 4))), cmap="gray",
                  vmin=0.0, vmax=1.0)
    print(f"wrote {path}")


def train_with_fit(gan, dataset, args, score, run):
  """Keras `fit`: one "epoch" per interval, scored by a callback."""

  class Score(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      logs["class_accuracy"] = score(gan.generator)

  history = gan.fit(
      dataset, epochs=args.steps // args.interval,
      steps_per_epoch=args.interval, verbose=2,
      shuffle=False,  # The dataset shuffles itself; Keras warns otherwise.
      callbacks=[Score(), keras.callbacks.TensorBoard(run.tensorboard_dir)])
  return history.history


def train_with_custom_loop(gan, dataset, args, score, run):
  """`strategy.run` in a `tf.function`, a line and summaries per interval."""
  strategy = run.strategy

  @tf.function
  def train_step(batch):
    d_loss, g_loss = strategy.run(gan.replica_step, args=batch)
    return (strategy.reduce("mean", d_loss, axis=None),
            strategy.reduce("mean", g_loss, axis=None))

  curves = {"d_loss": [], "g_loss": [], "class_accuracy": []}
  batches = iter(strategy.experimental_distribute_dataset(dataset))
  d_losses, g_losses = [], []
  for step in range(1, args.steps + 1):
    d_loss, g_loss = train_step(next(batches))
    d_losses.append(float(d_loss))
    g_losses.append(float(g_loss))
    if step % args.interval == 0:
      curves["d_loss"].append(np.mean(d_losses))
      curves["g_loss"].append(np.mean(g_losses))
      curves["class_accuracy"].append(score(gan.generator))
      d_losses, g_losses = [], []
      run.log("step", step, curves)
  return curves


def main():
  run = harness.start("sngan_digits", __doc__, add_arguments,
                      quick={"steps": 40, "interval": 20})
  args = run.args
  x_train, _, y_train, _ = digits.load_data()
  score = GeneratorScore(x_train, y_train)
  dataset = (tf.data.Dataset.from_tensor_slices(
      (x_train * 2.0 - 1.0, y_train.astype("int32")))  # images in [-1, 1]
             .shuffle(len(x_train), seed=0).repeat()
             .batch(args.global_batch_size, drop_remainder=True))

  with run.strategy.scope():
    gan = ConditionalGAN(build_generator(), build_discriminator())
    gan.compile(
        d_optimizer=keras.optimizers.Adam(args.learning_rate, beta_1=0.5),
        g_optimizer=keras.optimizers.Adam(args.learning_rate, beta_1=0.5))

  train = train_with_fit if args.loop == "fit" else train_with_custom_loop
  curves = train(gan, dataset, args, score, run)

  accuracy = score(gan.generator)
  run.plot_curves("curves.png", {
      "hinge losses": {"discriminator": curves["d_loss"],
                       "generator": curves["g_loss"]},
      "generated digits classified as intended": {
          "accuracy": curves["class_accuracy"]},
  }, x_label=f"x {args.interval} steps", title=(
      f"SN-GAN on digits ({args.loop}), {run.replicas}"))
  if run.is_chief:
    score.write_grid(gan.generator, run.path("samples.png"))
  print(f"generated digits classified as intended: {accuracy:.4f}")
  run.finish()


if __name__ == "__main__":
  main()
