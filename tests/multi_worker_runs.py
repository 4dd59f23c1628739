"""Training runs that must give the same numbers on 2 workers x 2 CPUs and on 4 CPUs.

Each function takes a strategy and returns plain JSON-able results, so a
worker process (`multi_worker_main.py`) and the test process (one process,
4 replicas) run the very same code. A run spec names a run and, after "@",
the options of its strategy: "keras_fit@bfloat16+shard_optimizer_state".
"""

import contextlib
import functools
import logging
import os
import pathlib
import signal
import socket
import types

import numpy as np
import tensorflow as tf
import keras

import models
import replicator_strategy as rs
from replicator_strategy import _tf_internal as tfi
from replicator_strategy.cluster import scratch
from replicator_strategy.collectives import watchdog
from replicator_strategy.keras import replica_loss

GLOBAL_BATCH = 16


def _row_parallel_layout():
  """Every kernel row-parallel over a worker's 2 devices, one replica each.

  The mesh names devices as strings: listing them through TensorFlow would
  start its runtime before the strategy joins the cluster.
  """
  layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
      (1, 2), ("batch", "model"), ["cpu:0", "cpu:1"]))
  layout_map[".*kernel"] = ("model", None)
  return layout_map


def _worker_mesh(axes):
  """A worker's mesh over its 2 devices, named as strings (see above)."""
  return keras.distribution.DeviceMesh((1, 2), axes, ["cpu:0", "cpu:1"])


# The strategy options a run spec may name.
STRATEGY_OPTIONS = {
    "row_parallel": {"layout_map": _row_parallel_layout()},
    # The same two, written as each worker's mesh.
    "mesh_row_parallel": {"mesh": _worker_mesh(("batch", "model")),
                          "layout_map": _row_parallel_layout()},
    "mesh_group_per_worker": {"mesh": _worker_mesh(("group", "batch")),
                              "sync": rs.SyncGroups(groups=2, average_every=4)},
    "shard_optimizer_state": {"shard_optimizer_state": True},
    "bfloat16": {"gradient_compression": "bfloat16"},
    # On 2 workers x 2: a sync group per worker.
    "2_sync_groups": {"sync_groups": 2, "average_every": 4},
    "4_sync_groups": {"sync_groups": 4, "average_every": 4},  # 2 per worker.
    "overlap": {"overlap_averaging": True},
    # A group per worker, its rounds sending int8 changes.
    "int8_rounds": {"sync": rs.SyncGroups(groups=2, average_every=4,
                                          outer_dtype="int8")},
    # Streaming DiLoCo's 2 fragments, overlapped.
    "2_sync_groups_fragments": {"sync": rs.SyncGroups(
        groups=2, average_every=4, fragments=2, overlap=True)},
    # 2 fragments, each one's rounds sending its int8 changes.
    "int8_fragments": {"sync": rs.SyncGroups(
        groups=2, average_every=4, fragments=2, outer_dtype="int8")},
    # One pipeline of 2 stages on each worker's 2 devices.
    "pipeline": {"pipeline": rs.Pipeline(stages=2, microbatches=2)},
    "zero3": {"sharding": rs.Sharding(weights="batch")},
    "4_shards": {"variable_partitioner": (
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(4))},
}


def parse(spec):
  """(run name, strategy options) of run spec "RUN" or "RUN@OPTION+OPTION"."""
  name, _, options = spec.partition("@")
  kwargs = {}
  for option in filter(None, options.split("+")):
    kwargs.update(STRATEGY_OPTIONS[option])
  return name, kwargs


def data(rows=58, seed=1):
  """Regression rows; 58 of them leave a final batch of 10 (split unevenly)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 8)).astype("float32")
  y = rng.normal(size=(rows, 3)).astype("float32")
  return x, y


def _model(strategy, optimizer=None, **compile_kwargs):
  with strategy.scope():
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    if optimizer:
      model.compile(optimizer=optimizer(), **compile_kwargs)
  return model


def _weights(model):
  return [w.tolist() for w in model.get_weights()]


def custom_loop(strategy):
  """Three epochs of a GradientTape loop with Keras SGD; losses and weights."""
  x, y = data()
  model = _model(strategy)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
    optimizer.build(model.trainable_variables)
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

  def replica_step(xb, yb):
    ctx = tf.distribute.get_replica_context()
    rows = ctx.all_reduce("sum", tf.cast(tf.shape(xb)[0], tf.float32))
    with tf.GradientTape() as tape:
      errors = tf.reduce_sum(tf.square(model(xb) - yb), axis=1)
      loss = tf.reduce_sum(errors) / rows
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return ctx.all_reduce("sum", loss)

  @tf.function
  def step(batch):
    return strategy.run(replica_step, batch)

  losses = []
  for _ in range(3):
    for batch in dataset:
      losses.append(float(strategy.experimental_local_results(step(batch))[0]))
  return {"losses": losses, "weights": _weights(model)}


def primitives(strategy):
  """Every replica-context and cross-replica collective, on replica ids."""

  def replica_fn():
    ctx = tf.distribute.get_replica_context()
    r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
    return {
        "sum": ctx.all_reduce("sum", r),
        "mean": ctx.all_reduce("mean", r),
        "min": ctx.all_reduce("min", r + 1.0),
        "max": ctx.all_reduce("max", r),
        "int_sum": ctx.all_reduce("sum", tf.cast(r, tf.int32) * 3 + 1),
        "int_mean": ctx.all_reduce("mean", tf.cast(r, tf.int32) * 3 + 1),
        "broadcast": ctx.broadcast(
            r * 10.0, source_replica_id=strategy.num_replicas_in_sync - 1),
        "all_gather": ctx.all_gather(tf.reshape(r, [1]), axis=0),
        "merge_call": ctx.merge_call(
            lambda s, v: s.reduce("sum", v, axis=None), args=(r,)),
        "in_cond": tf.cond(r >= 0.0, lambda: ctx.all_reduce("max", r),
                           lambda: r),
        "id": r,
    }

  results = {}
  for mode, fn in (("eager", replica_fn), ("function", tf.function(replica_fn))):
    out = strategy.run(fn)
    if mode == "eager":
      del out["in_cond"]  # tf.cond needs a trace to branch per replica.
    results[mode] = {
        k: [np.asarray(t).tolist()
            for t in strategy.experimental_local_results(v)]
        for k, v in out.items()
    }
    ids = out["id"]
    results[mode]["reduce"] = {
        op: float(strategy.reduce(op, ids, axis=None))
        for op in ("sum", "mean", "min", "max")
    }
    results[mode]["gather"] = np.asarray(strategy.gather(
        strategy.run(lambda r: tf.reshape(r, [1]), (ids,)), axis=0)).tolist()
  with strategy.scope():
    unseeded = tf.Variable(tf.random.uniform([4]))
  results["unseeded_variable"] = np.asarray(unseeded).tolist()
  return results


def slicing_collectives(strategy):
  """reduce_scatter (every op) and all_to_all, with gradients, by global replica.

  Eager and traced through merge_call, and traced inside a tf.cond (run-time
  collectives, in the gradient too).
  """
  n = strategy.num_replicas_in_sync
  ops = ("sum", "mean", "min", "max")
  values = np.random.default_rng(5).normal(size=(n, 4, 8)).astype("float32")
  weights = np.random.default_rng(6).normal(
      size=(n, 4, 8 // n)).astype("float32")

  def replica_fn(in_cond):
    ctx = tf.distribute.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    x = tf.gather(tf.constant(values), rid)
    w = tf.gather(tf.constant(weights), rid)
    if in_cond:
      call = lambda f: tf.cond(rid >= 0, f, f)
    else:
      call = lambda f: f()
    out = {op: call(lambda op=op: ctx.reduce_scatter(op, {"x": x}, 1))["x"]
           for op in ops}
    out["all_to_all"] = call(lambda: ctx.all_to_all(x, 1, 0))
    exchanges = {op: (lambda op=op: ctx.reduce_scatter(op, x, 1), w)
                 for op in ops}
    exchanges["all_to_all"] = (lambda: ctx.all_to_all(x, 1, 0),
                               tf.tile(w, [n, 1]))
    out["gradients"] = {}
    for name, (exchange, weight) in exchanges.items():
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(call(exchange) * weight)
      out["gradients"][name] = tape.gradient(loss, x)
    return out

  results = {}
  for mode, fn in (("eager", lambda: replica_fn(False)),
                   ("function", tf.function(lambda: replica_fn(False))),
                   ("in_cond", tf.function(lambda: replica_fn(True)))):
    local = strategy.experimental_local_results(strategy.run(fn))
    results[mode] = {
        str(strategy.extended.first_replica_id + i):
            tf.nest.map_structure(lambda t: np.asarray(t).tolist(), r)
        for i, r in enumerate(local)}
  return results


def map_gather(strategy, num_thunks=6):
  """map_gather's results and gradients by global replica, beside every
  replica computing every thunk itself, and the (thunk, replica) of each run
  of a thunk on this worker.

  Eagerly and traced through merge_call, and traced inside a tf.cond.
  """
  a = np.random.default_rng(8).normal(size=(num_thunks, 3, 3))
  matrices = (a @ a.transpose(0, 2, 1) + 3 * np.eye(3)).astype("float32")
  ran = []

  def replica_fn(in_cond):
    ctx = tf.distribute.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    call = (lambda f: tf.cond(rid >= 0, f, f)) if in_cond else (lambda f: f())
    scales = [tf.constant(1.0 + k / 10) for k in range(num_thunks)]

    def inverse(k, recorded):
      result = tf.linalg.inv(tf.constant(matrices[k]) * scales[k])
      if not recorded:
        return result
      record = lambda replica: ran.append([k, int(replica)]) or np.float32(0)
      return result + tf.reshape(tf.py_function(record, [rid], tf.float32), [])

    out = {}
    for name, results in (
        ("map_gather", lambda: ctx.map_gather(
            [lambda k=k: inverse(k, True) for k in range(num_thunks)])),
        ("everything", lambda: tuple(inverse(k, False)
                                     for k in range(num_thunks)))):
      with tf.GradientTape() as tape:
        tape.watch(scales)
        values = call(results)
        loss = tf.cast(rid + 1, tf.float32) * tf.add_n(
            [tf.reduce_sum(v) for v in values])
      out[name] = {"values": values, "gradients": tape.gradient(
          loss, scales, unconnected_gradients=tf.UnconnectedGradients.ZERO)}
    return out

  results = {}
  for mode, fn in (("eager", lambda: replica_fn(False)),
                   ("function", tf.function(lambda: replica_fn(False))),
                   ("in_cond", tf.function(lambda: replica_fn(True)))):
    ran.clear()
    local = strategy.experimental_local_results(strategy.run(fn))
    results[mode] = {"ran": sorted(ran), "replicas": {
        str(strategy.extended.first_replica_id + i):
            tf.nest.map_structure(lambda t: np.asarray(t).tolist(), r)
        for i, r in enumerate(local)}}
  return results


def keras_fit(strategy, steps_per_execution=1, accumulation_steps=None,
              optimizer=keras.optimizers.Adam):
  """fit / evaluate / predict with an uneven final batch; every number."""
  x, y = data()
  xv, yv = data(rows=27, seed=2)
  model = _model(strategy, lambda: optimizer(
      0.01, gradient_accumulation_steps=accumulation_steps), loss="mse",
                 metrics=["mae"], steps_per_execution=steps_per_execution)
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False,
                      validation_data=(xv, yv), verbose=0)
  evaluation = model.evaluate(xv, yv, batch_size=8, verbose=0)
  prediction = model.predict(xv, batch_size=8, verbose=0)
  return {"history": history.history, "evaluate": evaluation,
          "predict": prediction.tolist(), "weights": _weights(model)}


def sync_groups_fit(strategy):
  """`keras_fit`'s numbers, and what passed between the sync groups during
  it: the rounds and the bytes they averaged."""
  averaging = strategy.averaging
  rounds, averaged = averaging.rounds, averaging.bytes_averaged
  results = keras_fit(strategy)
  return {**results, "rounds": averaging.rounds - rounds,
          "bytes_averaged": averaging.bytes_averaged - averaged}


def replica_metrics(model, replicas=None):
  """The metric results of each `replicas` (None: all) of this worker's
  replicas, in order, from their metric variables summed here, outside any
  step."""
  strategy = model.distribute_strategy
  variables = [v for metric in model.metrics for v in metric.variables]
  parts = [strategy.experimental_local_results(v.value) for v in variables]
  replicas = replicas or len(parts[0])
  results = []
  for first in range(0, len(parts[0]), replicas):
    sums = [tf.add_n(list(p[first:first + replicas])) for p in parts]
    with keras.StatelessScope(state_mapping=list(zip(variables, sums))):
      results.append({name: float(value) for name, value in
                      model.get_metrics_result().items()})
  return results


class StepLogs(keras.callbacks.Callback):
  """Each train step's logs; after it, the metrics (`replica_metrics`) of
  each pair of this worker's replicas (a worker's on 2 workers x 2) and of
  all of them; and the collectives launched between workers during it (its
  train function and the round after it, if due)."""

  def __init__(self):
    super().__init__()
    self.logs, self.pairs, self.local, self.launches = [], [], [], []
    self._launched = None

  def on_train_batch_begin(self, batch, logs=None):
    self._launched = watchdog.launches_between_workers()

  def on_train_batch_end(self, batch, logs=None):
    self.launches.append(watchdog.launches_between_workers() - self._launched)
    self.logs.append({name: float(value) for name, value in logs.items()})
    self.pairs.append(replica_metrics(self.model, 2))
    self.local.append(replica_metrics(self.model)[0])


def sync_groups_step_logs(strategy):
  """3 epochs of `fit` (12 steps) in sync groups: each step's logs, its
  replicas' metrics and the launches between workers (`StepLogs`), and the
  History."""
  x, y = data()
  model = _model(strategy, lambda: keras.optimizers.SGD(0.1), loss="mse",
                 metrics=["mae"])
  steps = StepLogs()
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False,
                      verbose=0, callbacks=[steps])
  return {"logs": steps.logs, "pairs": steps.pairs, "local": steps.local,
          "launches": steps.launches, "history": history.history}


def sync_groups_loop(strategy, steps=8):
  """A custom loop in sync groups, each replica's rows chosen by its global
  replica id (so on any topology); losses, the kernels after each step, and
  the weights after a last round (with `overlap_averaging`, it applies the
  exchange in flight)."""
  x, y = data(rows=GLOBAL_BATCH * steps)
  model = _model(strategy)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
    optimizer.build(model.trainable_variables)
  per_replica = GLOBAL_BATCH // strategy.extended.num_replicas_in_all_groups

  def rows(step):
    def of_replica(ctx):
      first = GLOBAL_BATCH * step + per_replica * ctx.replica_id_in_sync_group
      return (tf.constant(x[first:first + per_replica]),
              tf.constant(y[first:first + per_replica]))
    return strategy.experimental_distribute_values_from_function(of_replica)

  def replica_step(xb, yb):
    ctx = tf.distribute.get_replica_context()
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(xb) - yb))
      # The optimizer sums the gradients over the group: its mean.
      scaled = loss / ctx.num_replicas_in_sync
    optimizer.apply_gradients(zip(tape.gradient(scaled,
                                                model.trainable_variables),
                                  model.trainable_variables))
    return ctx.all_reduce_all_groups("mean", loss)

  @tf.function
  def step(xb, yb):
    return strategy.run(replica_step, (xb, yb))

  strategy.sync_groups_step(0, model.trainable_variables)
  losses, kernels = [], []
  for i in range(steps):
    losses.append(float(strategy.experimental_local_results(
        step(*rows(i)))[0]))
    strategy.sync_groups_step(i + 1, model.trainable_variables)
    kernels.append([k.numpy().tolist() for k in
                    strategy.experimental_local_results(model.layers[0].kernel.value)])
  strategy.average_sync_groups(model.trainable_variables)
  return {"losses": losses, "kernels": kernels, "weights": _weights(model)}


def sharded_state(strategy, workdir=None):
  """After `fit`: each slot's shard sizes on this worker, and its whole value.

  With a `workdir`, every worker also saves the model there (the chief's file
  is kept).
  """
  model = _model(strategy, lambda: keras.optimizers.Adam(0.01), loss="mse")
  x, y = data()
  model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
  if workdir:
    model.save(pathlib.Path(workdir) / "sharded.keras")
  slots = [v for v in model.optimizer.variables if v.shape == v.value.shape
           and v.path.split("/")[-1] not in ("iteration", "learning_rate")]
  return {"shard_sizes": [[int(c.shape.num_elements())
                           for c in strategy.experimental_local_results(
                               s.value)] for s in slots],
          "slots": [s.numpy().tolist() for s in slots]}


def embedding_fit(strategy):
  """An Embedding model's fit and predict (uneven final batch), every number.

  Also, per weight, the rows of this worker's shards (empty if unsharded).
  """
  rng = np.random.default_rng(3)
  ids = rng.integers(0, 40, size=(58, 5)).astype("int32")
  _, y = data()
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"), keras.layers.Embedding(40, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.05), "mse")
  history = model.fit(ids, y, batch_size=GLOBAL_BATCH, epochs=2,
                      shuffle=False, verbose=0)
  return {"history": history.history, "weights": _weights(model),
          "predict": model.predict(ids, batch_size=8, verbose=0).tolist(),
          "slots": [v.numpy().tolist() for v in model.optimizer.variables],
          "shard_rows": [
              [int(c.shape[0]) for c in strategy.experimental_local_results(
                  w.value)] if hasattr(w.value, "layout") else []
              for w in model.weights]}


def keras_custom_steps(strategy):
  """The Keras guide's custom train_step/test_step, and a layer's add_loss:
  logs, evaluation and weights after fit on 60 rows (a short final batch).

  The guide's loss tracker averages the replicas' losses unweighted (a known
  limit, docs/keras.md), so its logs depend on how a batch is cut: the final
  12 rows are cut 3, 3, 3, 3 by one process and by TF's input across workers
  alike, where 10 would be cut 3, 3, 2, 2 and 3, 3, 3, 1.
  """
  import test_keras_dropin as dropin  # pylint: disable=g-import-not-at-top
  x, y = data(rows=60)
  results = {}
  for name, build in (("custom_step", dropin.CustomStepModel),
                      ("add_loss", dropin.layer_loss_model)):
    with strategy.scope():
      keras.utils.set_random_seed(0)
      model = build()
      model.build((None, 8))
      model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0).history["loss"]
    results[name] = {"history": history,
                     "evaluate": model.evaluate(x, y, verbose=0),
                     "weights": _weights(model)}
  return results


def fewer_rows_than_replicas(strategy):
  """Dense and LSTM models on 1 and 3 rows (fewer than the 4 replicas):
  predictions, evaluation and weights after fit."""
  import test_keras_dropin as dropin  # pylint: disable=g-import-not-at-top
  results = {}
  for kind in ("dense", "lstm"):
    for rows in (1, 3):
      predicted, evaluated, weights = (
          dropin.FewerRowsThanReplicasTest.run_model(kind, strategy, rows,
                                                     train=True)[-1])
      results[f"{kind}_{rows}"] = {
          "predict": predicted.tolist(), "evaluate": evaluated,
          "weights": [w.tolist() for w in weights]}
  return results


def conv_last_batches(strategy):
  """A conv net's fit, evaluate and predict with last batches of 1 to 7 rows,
  which leave replicas few rows or none."""
  import test_empty_replicas  # pylint: disable=g-import-not-at-top
  return test_empty_replicas.last_batches(strategy)


def random_layers_fit(strategy):
  """fit of models with Dropout and with RandomFlip + RandomRotation.

  Each replica reads rows of the global batch contiguously, in replica order,
  as one process cuts it, as evenly as can be (Keras's NumPy input would be
  sharded by element, giving each worker every other row).
  """
  import test_random_layers  # pylint: disable=g-import-not-at-top
  n = strategy.num_replicas_in_sync

  def contiguous_parts(dataset, context):
    per_worker = n // context.num_input_pipelines
    first = context.input_pipeline_id * per_worker

    def parts(x, y):
      rows = tf.shape(x)[0]
      base, extra = rows // n, rows % n

      def part(replica):
        replica = tf.cast(replica, tf.int32)
        start = replica * base + tf.minimum(replica, extra)
        end = start + base + tf.cast(replica < extra, tf.int32)
        return x[start:end], y[start:end]

      return tf.data.Dataset.range(first, first + per_worker).map(part)

    return dataset.flat_map(parts)

  return {name: test_random_layers.train(name, strategy, contiguous_parts)
          for name in ("conv_dropout", "augmented_images")}


def pipeline_mlp():
  """3 tanh Dense blocks, each with a dropout, and a Dense head."""
  layers = [keras.Input((8,))]
  for i in range(3):
    layers += [keras.layers.Dense(16, activation="tanh", name=f"dense_{i}"),
               keras.layers.Dropout(0.2, name=f"dropout_{i}")]
  return keras.Sequential(layers + [keras.layers.Dense(3, name="head")])


def pipeline_fit(strategy):
  """Adam's `fit` of `pipeline_mlp` for 2 epochs (a final batch of 10 rows),
  then `evaluate` and `predict` (a final batch of 3); every number, the
  replicas in sync and the device and shape of each weight's parts on this
  worker.

  On 2 workers x 1 replica, Keras's NumPy input gives each worker its
  replica's rows contiguously, the rows one device draws their dropout
  values for.
  """
  x, y = data()
  xv, yv = data(rows=27, seed=2)
  keras.utils.set_random_seed(0)
  weights = pipeline_mlp().get_weights()
  with strategy.scope():
    model = pipeline_mlp()
    model.set_weights(weights)
    model.compile(keras.optimizers.Adam(0.01), "mse")
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                      verbose=0)
  return {"loss": history.history["loss"], "weights": _weights(model),
          "evaluate": model.evaluate(xv, yv, batch_size=8, verbose=0),
          "predict": model.predict(xv, batch_size=8, verbose=0).tolist(),
          "replicas": strategy.num_replicas_in_sync,
          "parts": [[[part.device, part.shape.as_list()] for part in
                     strategy.experimental_local_results(w.value)]
                    for w in model.weights]}


def peer_dies(strategy, fate=signal.SIGKILL):
  """Trains step after step; worker 1 gets `fate` after two steps.

  SIGKILL: it exits at once (status 3); SIGSTOP: it freezes; SIGTERM: it is
  preempted in a loop that does not save.
  """
  model = _model(strategy)
  x, _ = data()

  @tf.function
  def step():
    return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
        "sum", tf.reduce_sum(model(x))))

  for i in range(1000):
    step()
    if i == 1 and strategy.extended.cluster.worker_index == 1:
      if fate == signal.SIGKILL:
        os._exit(3)  # pylint: disable=protected-access
      os.kill(os.getpid(), fate)
  return {}


def keras_files(strategy, workdir):
  """fit with ModelCheckpoint, TensorBoard, BackupAndRestore; save, export.

  Also this process's scratch root (if any), before and after.
  """
  scratch_before = list(scratch._scratch_root)  # pylint: disable=protected-access
  x, y = data()
  workdir = pathlib.Path(workdir)
  model = _model(strategy, lambda: keras.optimizers.SGD(0.05), loss="mse")
  model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[
      keras.callbacks.ModelCheckpoint(str(workdir / "ckpt-{epoch}.keras")),
      keras.callbacks.TensorBoard(str(workdir / "logs")),
      keras.callbacks.BackupAndRestore(str(workdir / "backup")),
  ])
  model.save(workdir / "final.keras")
  model.save_weights(workdir / "final.weights.h5")
  model.export(str(workdir / "exported"))
  return {"scratch_before": scratch_before,
          "scratch": list(scratch._scratch_root),  # pylint: disable=protected-access
          "weights": _weights(model)}


class _Interrupt(keras.callbacks.Callback):
  """Stops the process at the end of epoch `at`, the first time only."""

  def __init__(self, marker, at):
    super().__init__()
    self._marker = marker
    self._armed = not marker.exists()  # Read before any worker trains.
    self._at = at

  def on_epoch_end(self, epoch, logs=None):
    if self._armed and epoch == self._at:
      self._marker.touch()
      raise SystemExit(7)


def keras_backup_and_restore(strategy, workdir=None):
  """4 epochs with BackupAndRestore; with a workdir, cut after epoch 2 once."""
  x, y = data()
  model = _model(strategy, lambda: keras.optimizers.Adam(0.01), loss="mse")
  callbacks = []
  if workdir:
    workdir = pathlib.Path(workdir)
    callbacks = [keras.callbacks.BackupAndRestore(str(workdir / "backup")),
                 _Interrupt(workdir / "interrupted", at=1)]
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, verbose=0,
                      shuffle=False, callbacks=callbacks)
  return {"weights": _weights(model), "loss": history.history["loss"]}


class _ExitOnFirstStart(keras.callbacks.Callback):
  """Every worker exits with status 7 at the end of epoch `at`, on the
  launcher's first start only (REPLICATOR_RESTART_COUNT numbers them)."""

  def __init__(self, at):
    super().__init__()
    self._armed = os.environ.get("REPLICATOR_RESTART_COUNT", "0") == "0"
    self._at = at

  def on_epoch_end(self, epoch, logs=None):
    if self._armed and epoch == self._at:
      raise SystemExit(7)


def keras_accumulation_restarted(strategy, workdir=None):
  """4 epochs of 4 steps, gradient_accumulation_steps=3, BackupAndRestore;
  with a workdir, every worker exits after epoch 2 on the first start, with
  one step pending in each replica's accumulators."""
  x, y = data()
  model = _model(strategy, lambda: keras.optimizers.Adam(
      0.01, gradient_accumulation_steps=3), loss="mse")
  callbacks = []
  if workdir:
    callbacks = [keras.callbacks.BackupAndRestore(
        str(pathlib.Path(workdir) / "backup")), _ExitOnFirstStart(at=1)]
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, verbose=0,
                      shuffle=False, callbacks=callbacks)
  return {"weights": _weights(model), "loss": history.history["loss"]}


class _SignalAt(keras.callbacks.Callback):
  """Worker 1 sends itself `sig` after `step` batches, on the first start only.

  The launcher numbers the starts in REPLICATOR_RESTART_COUNT.
  """

  def __init__(self, strategy, sig, step):
    super().__init__()
    self._armed = (strategy.extended.cluster.worker_index == 1 and
                   os.environ.get("REPLICATOR_RESTART_COUNT", "0") == "0")
    self._sig, self._step, self._steps = sig, step, 0

  def on_train_batch_end(self, batch, logs=None):
    self._steps += 1
    if self._armed and self._steps == self._step:
      print(f"sending {signal.Signals(self._sig).name} to worker 1",
            flush=True)
      os.kill(os.getpid(), self._sig)


def keras_preempted(strategy, workdir, sig=signal.SIGTERM):
  """keras_backup_and_restore; worker 1 gets `sig` in epoch 3 on the first start.

  4 batches per epoch: the signal comes after batch 2 of epoch 3 (step 10),
  when the backup of epoch 2 is on disk.
  """
  x, y = data()
  model = _model(strategy, lambda: keras.optimizers.Adam(0.01), loss="mse")
  callbacks = [keras.callbacks.BackupAndRestore(
      str(pathlib.Path(workdir) / "backup")), _SignalAt(strategy, sig, 10)]
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, verbose=0,
                      shuffle=False, callbacks=callbacks)
  return {"weights": _weights(model), "loss": history.history["loss"]}


class _WritePid(keras.callbacks.Callback):
  """Writes pid<worker> into `workdir` once the first epoch is backed up."""

  def __init__(self, strategy, workdir):
    super().__init__()
    self._path = pathlib.Path(workdir) / (
        f"pid{strategy.extended.cluster.worker_index}")

  def on_epoch_end(self, epoch, logs=None):
    if epoch == 0:
      self._path.write_text(str(os.getpid()))


def keras_until_stopped(strategy, workdir):
  """fit with BackupAndRestore for longer than any test waits."""
  x, y = data()
  model = _model(strategy, lambda: keras.optimizers.Adam(0.01), loss="mse")
  model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=100000, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(
                str(pathlib.Path(workdir) / "backup")),
                       _WritePid(strategy, workdir)])
  return {}


def custom_loop_preempted(strategy, workdir=None):
  """12 steps of SGD with momentum from a step-counted checkpoint.

  With a workdir, worker 1 gets SIGTERM after step 5 on the first start.
  """
  x, y = data(rows=64)
  model = _model(strategy)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64, trainable=False)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
  if workdir:
    saver = rs.PreemptionCheckpoint(strategy, checkpoint,
                                    str(pathlib.Path(workdir) / "ckpt"))
  else:
    saver = contextlib.nullcontext(
        types.SimpleNamespace(step_done=lambda: None))
  armed = (workdir and strategy.extended.cluster.worker_index == 1 and
           os.environ.get("REPLICATOR_RESTART_COUNT", "0") == "0")
  start = int(step.numpy())
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
      .skip(start).take(12 - start))

  def replica_step(xb, yb):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(xb) - yb)) / GLOBAL_BATCH
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def train_step(batch):
    strategy.run(replica_step, batch)

  with saver as preemption:
    for batch in dataset:
      train_step(batch)
      step.assign_add(1)
      if armed and int(step.numpy()) == 5:
        os.kill(os.getpid(), signal.SIGTERM)
      preemption.step_done()
  return {"weights": _weights(model), "start": start}


def listening_addresses(strategy):
  """Where this worker's server listens (/proc/net/tcp{,6}), in which network."""
  cluster = strategy.extended.cluster
  port = int(cluster.addresses[cluster.worker_index].rpartition(":")[2])
  found = []
  for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    lines = pathlib.Path("/proc/net", name).read_text().splitlines()[1:]
    for line in lines:
      local, state = line.split()[1], line.split()[3]
      address, local_port = local.split(":")
      if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN.
        raw = bytes.fromhex(address)
        # The kernel prints each 32-bit word in host (little-endian) order.
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        found.append(socket.inet_ntop(family, raw))
  interfaces = [line.split(":")[0].strip() for line in
                pathlib.Path("/proc/self/net/dev").read_text().splitlines()[2:]]
  return {"port": port, "listening": found, "interfaces": interfaces,
          "network_namespace": os.readlink("/proc/self/ns/net")}


def input_pipelines(strategy):
  """What each worker's input pipeline is told, and the no-sharding warning."""
  contexts = []

  def dataset_fn(context):
    contexts.append([context.input_pipeline_id, context.num_input_pipelines,
                     context.get_per_replica_batch_size(8)])
    return tf.data.Dataset.range(8).shard(
        context.num_input_pipelines, context.input_pipeline_id).batch(2)

  dataset = strategy.distribute_datasets_from_function(dataset_fn)
  rows = [np.concatenate([np.asarray(t) for t in
                          strategy.experimental_local_results(b)]).tolist()
          for b in dataset]
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  with _captured_warnings() as warnings:
    strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(8).batch(4).with_options(options))
  return {"contexts": contexts, "rows": rows, "warnings": warnings}


def batch_share(strategy):
  """Each replica's share of the rows; replica r has r + 1 of them."""
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.ones([ctx.replica_id_in_sync_group + 1, 2]))
  shares = tf.function(lambda: strategy.run(
      lambda x: replica_loss.batch_share(
          tf.distribute.get_replica_context()),
      (values,)))
  return [float(s) for s in strategy.experimental_local_results(shares())]


def collectives_per_step(strategy):
  """The collectives each traced step launches, by step, and each replica's
  batch share read inside a tf.cond; replica r has r + 1 rows."""
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: [tf.ones([ctx.replica_id_in_sync_group + 1, 2]),
                   tf.ones([3]), tf.ones([3, 2]), tf.ones([2]), tf.ones([4])])

  def share(_):
    return replica_loss.batch_share(tf.distribute.get_replica_context())

  steps = {
      "empty": lambda v: v[0] * 2.0,
      "batch_share": share,
      "batch_share_in_cond": lambda v: tf.cond(
          tf.reduce_sum(v[1]) > 0.0, lambda: share(v), lambda: 0.0),
      "all_reduce_4_tensors": lambda v: tf.distribute.get_replica_context(
          ).all_reduce("sum", v[1:]),
  }
  results = {}
  for name, fn in steps.items():
    step = tf.function(lambda fn=fn: strategy.run(fn, (values,)))
    results[name] = _collectives(step.get_concrete_function().graph)
  in_cond = tf.function(lambda: strategy.run(steps["batch_share_in_cond"],
                                             (values,)))
  results["shares_in_cond"] = [
      float(s) for s in strategy.experimental_local_results(in_cond())]
  return results


def _collectives(graph):
  """How many collective ops `graph` and the functions it calls hold."""
  count = 0
  for op in graph.get_operations():
    count += op.type.startswith("Collective")
    count += sum(_collectives(g) for g in tfi.called_function_graphs(op))
  return count


@contextlib.contextmanager
def _captured_warnings():
  caught = []
  handler = logging.Handler(level=logging.WARNING)
  handler.emit = lambda record: caught.append(record.getMessage())
  absl_logger = logging.getLogger("absl")
  absl_logger.addHandler(handler)
  try:
    yield caught
  finally:
    absl_logger.removeHandler(handler)


RUNS = {"custom_loop": custom_loop, "primitives": primitives,
        "keras_fit": keras_fit, "peer_dies": peer_dies,
        "peer_freezes": functools.partial(peer_dies, fate=signal.SIGSTOP),
        "keras_files": keras_files,
        "keras_backup_and_restore": keras_backup_and_restore,
        "keras_fit_steps_per_execution": functools.partial(
            keras_fit, steps_per_execution=3),
        "keras_fit_accumulation": functools.partial(keras_fit,
                                                    accumulation_steps=2),
        "keras_fit_nadam": functools.partial(
            keras_fit, optimizer=keras.optimizers.Nadam),
        "input_pipelines": input_pipelines,
        "collectives_per_step": collectives_per_step,
        "keras_preempted": keras_preempted,
        "keras_accumulation_restarted": keras_accumulation_restarted,
        # Without the workdir: no backup, no exit.
        "keras_accumulation_uninterrupted": keras_accumulation_restarted,
        "keras_killed": functools.partial(keras_preempted, sig=signal.SIGKILL),
        "peer_gets_sigterm": functools.partial(peer_dies, fate=signal.SIGTERM),
        "keras_until_stopped": keras_until_stopped,
        "custom_loop_preempted": custom_loop_preempted,
        "listening_addresses": listening_addresses,
        "slicing_collectives": slicing_collectives, "map_gather": map_gather,
        "sharded_state": sharded_state, "embedding_fit": embedding_fit,
        "keras_custom_steps": keras_custom_steps,
        "fewer_rows_than_replicas": fewer_rows_than_replicas,
        "conv_last_batches": conv_last_batches,
        "batch_share": batch_share, "random_layers_fit": random_layers_fit,
        "pipeline_fit": pipeline_fit,
        "sync_groups_fit": sync_groups_fit,
        "sync_groups_loop": sync_groups_loop,
        "sync_groups_step_logs": sync_groups_step_logs}
# Runs that take the output directory as their working directory.
TAKES_WORKDIR = ("keras_files", "keras_backup_and_restore", "keras_preempted",
                 "keras_accumulation_restarted",
                 "keras_killed", "keras_until_stopped",
                 "custom_loop_preempted", "sharded_state")
