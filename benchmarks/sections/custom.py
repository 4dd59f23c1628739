"""Custom-loop (GradientTape) step time.

The `fit` section's models and contenders, stepped by a traced function of
our own. `custom_rows` also times parts of the step (the `parts` section).
"""

import time

import keras
import tensorflow as tf

from benchmarks import contenders
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import fit

# Each part adds one stage to the step before it; "+ update" is the whole
# step.
STEP_PARTS = ("forward", "+ backward", "+ all-reduce", "+ update")


def custom_step(size, model, optimizer, strategy, part="+ update", slices=1):
  """A traced step running one of `STEP_PARTS`; returns the summed loss.

  With `slices`, the model runs on that many slices of the batch in turn
  (no strategy): the replicas' compute without any replication.
  """
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="sum")
  batch = size["global_batch"]

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.add_n([loss_fn(y_slice, model(x_slice, training=True))
                       for x_slice, y_slice in zip(tf.split(x, slices),
                                                   tf.split(y, slices))])
      loss /= batch
    if part == "forward":
      return loss
    grads = tape.gradient(loss, model.trainable_variables)
    if part == "+ update":
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    if part == "+ all-reduce":
      grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
    # Depends on every gradient, so none is pruned from the trace.
    return loss + 0 * tf.add_n([tf.reduce_sum(g) for g in grads])

  if strategy is None:
    return tf.function(replica_step)

  @tf.function
  def step(x, y):
    losses = strategy.run(replica_step, (x, y))
    return strategy.reduce("sum", losses, axis=None)

  return step


def custom_rows(options, n, model_names=tuple(models.MODELS),
                parts=("+ update",), sliced=False, names=fit.NAMES,
                section_name=None):
  """Custom-loop step times; with several `parts`, one row per part.

  `sliced` adds the contender "none, sliced": no strategy, the batch in `n`
  slices one after another. Each row is reported as it comes under
  `section_name` (default "custom").
  """
  size = options.size
  rows = []
  for model_name in model_names:
    runs = _step_runs(size, n, model_name, parts, names + (
        ("none, sliced",) if sliced else ()))
    _step_rounds(size, runs)
    for part in parts:
      of_part = {name: r for (name, p), r in runs.items() if p == part}
      rows.append({
          "model": model_name, "replicas": n,
          "ms": {name: timing.median_ms(r["times"])
                 for name, r in of_part.items()},
          # The update changes the weights between the parts' runs.
          "agree": models.losses_agree(
              model_name, {k: r["losses"] for k, r in of_part.items()})})
      if len(parts) > 1:
        rows[-1]["part"] = part
      tables.progress(section_name or SECTION.name, rows[-1])
  return rows


def _step_runs(size, n, model_name, parts, names):
  """{(name, part): run} with each contender's model, optimizer and data."""
  weights = models.initial_weights(size, model_name)
  x, y = models.data(size, model_name, size["fit_steps"])
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
      size["global_batch"]).cache()
  runs = {}
  for name in names:
    sliced = name == "none, sliced"
    strategy = None if sliced else contenders.contender(name, n)
    with contenders.scope(strategy):
      model = models.MODELS[model_name](size)
      model.set_weights(weights)
      optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
      optimizer.build(model.trainable_variables)
    batches = list(strategy.experimental_distribute_dataset(dataset)
                   if strategy else dataset)
    for part in parts:
      runs[name, part] = {
          "step": custom_step(size, model, optimizer, strategy, part,
                              slices=n if sliced else 1),
          "batches": batches, "times": [], "losses": []}
  return runs


def _step_rounds(size, runs):
  """A warm-up round (tracing; its losses) then `rounds` timed rounds."""
  for round_index in range(size["rounds"] + 1):
    for run in runs.values():
      for x_batch, y_batch in run["batches"]:
        start = time.perf_counter()
        loss = float(run["step"](x_batch, y_batch))
        if round_index == 0:
          run["losses"].append(loss)
        else:
          run["times"].append(time.perf_counter() - start)


SECTION = section.Section(
    name="custom", measures="custom-loop step time, same models as fit",
    per_replicas=custom_rows,
    table=lambda options, rows: tables.contender_table(
        "Custom-loop step, ms (median)", rows))
