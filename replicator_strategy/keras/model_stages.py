"""A Keras model cut into pipeline stages (`split_model`).

Reads a Functional or Sequential model's layer graph (Keras's own, through
`_internal`) into the calls `pipeline.stages` cuts, each run as the model's
`call` runs it: the same arguments, `training` passed the same way, Keras
masks carried with their tensors. A nested model (a model used as a layer)
is one call: its layers stay in one stage.

>>> import keras
>>> model = keras.Sequential(
...     [keras.Input((4,))] +
...     [keras.layers.Dense(4, name=f"dense_{i}") for i in range(4)])
>>> stages = split_model(model, 2)
>>> [[layer.name for layer in stage.layers] for stage in stages]
[['dense_0', 'dense_1'], ['dense_2', 'dense_3']]
>>> stages[0].outputs, stages[1].inputs, stages[1].outputs
(('dense_1:0:0',), ('dense_1:0:0',), ('output:0',))
"""

import functools

import keras

from replicator_strategy.keras import _internal
from replicator_strategy.pipeline import balance as balance_lib
from replicator_strategy.pipeline import stages as stages_lib

_MASK = "/mask"
BALANCES = ("params", "time")


def split_model(model, stages, split=None, balance="params", sample=None):
  """`model` cut into `stages` consecutive `pipeline.stages.Stage`s.

  Args:
    model: a built Keras Functional or Sequential model.
    stages: how many stages (an int >= 1).
    split: None (cut where `balance` says), or the name of the first layer
      of each stage after the first (`stages` - 1 names, in call order).
    balance: what the cuts even out (the rule is `pipeline.balance`'s):
      "params", the stages' parameter counts, or "time", their layers'
      forward times measured on `sample`.
    sample: a batch of the model's input, for `balance="time"`.

  Returns:
    A tuple of Stages; running them in order (`pipeline.stages.
    model_outputs`) computes what `model(x, training=...)` does.
  """
  if balance not in BALANCES:
    raise ValueError(
        f"Expected `balance` to be one of {BALANCES}. Received: "
        f"balance={balance!r}.")
  if balance == "time" and sample is None:
    raise ValueError(
        "balance='time' measures each layer's forward time on a sample "
        "batch. Received: sample=None. Pass sample=<a batch of the model's "
        "input> (a few rows as in training), or balance='params'.")
  graph = layer_graph(model)
  costs = None
  if balance == "time" and split is None:
    costs = balance_lib.timed_costs(graph.calls, graph.feed(sample))
  return stages_lib.cut(graph, stages, split, costs)


def _functional_graph(model):
  """The Functional graph whose run is `model`'s call, or a clear error."""
  if not isinstance(model, keras.Model):
    raise ValueError(
        f"Expected `model` to be a Keras Functional or Sequential model. "
        f"Received: model={model!r} of type {type(model).__name__}.")
  if isinstance(model, keras.Sequential):
    runs_graph = type(model).call is keras.Sequential.call
  else:
    runs_graph = (isinstance(model, _internal.Functional) and
                  type(model).call is _internal.Functional.call)
  if not runs_graph:
    raise ValueError(
        f"A pipeline cuts a model along its layer graph, which "
        f"{type(model).__name__} {model.name!r} (a subclassed model, its own "
        f"`call`) does not have. Received: model={model.name!r}. Rewrite it "
        f"as a Functional model (keras.Model(inputs, outputs)) or a "
        f"keras.Sequential.")
  graph = _internal.graph_of(model)
  if graph is None:
    raise ValueError(
        f"Sequential model {model.name!r} has no layer graph to cut: it is "
        f"not built, or holds no layer. Received: model={model.name!r} "
        f"(layers: {[layer.name for layer in model.layers]}). Start it with "
        f"keras.Input(shape) (or call `model.build(input_shape)`) and give it "
        f"layers.")
  return graph


def layer_graph(model):
  """`model`'s calls, in the order its `call` runs them (`LayerGraph`)."""
  graph = _functional_graph(model)
  nodes = _internal.graph_nodes(graph)
  own = {id(node) for node in nodes}
  names = {id(t): f"input:{i}" for i, t in enumerate(graph.inputs)}
  calls = []
  for node in nodes:
    layer = node.operation
    k = [n for n in _internal.call_nodes(layer) if id(n) in own].index(node)
    reads = _with_masks(
        list(dict.fromkeys(names[id(t)] for t in node.input_tensors)),
        node.input_tensors, names)
    for j, t in enumerate(node.outputs):
      names[id(t)] = f"{layer.name}:{k}:{j}"
    writes = _with_masks([names[id(t)] for t in node.outputs], node.outputs,
                         names)
    calls.append(stages_lib.LayerCall(
        layer, tuple(reads), tuple(writes), functools.partial(
            _run_node, node, [names[id(t)] for t in node.input_tensors],
            [names[id(t)] for t in node.outputs], frozenset(writes))))
  return stages_lib.LayerGraph(
      name=model.name, inputs=tuple(names[id(t)] for t in graph.inputs),
      outputs=tuple(names[id(t)] for t in graph.outputs), calls=tuple(calls),
      feed=functools.partial(_feed, model, graph),
      pack=functools.partial(_internal.pack_outputs, graph),
      added_losses=_added_losses)


def _added_losses(layer):
  """The losses `layer`'s latest call added, each summed to a float scalar
  as `Model.compute_loss` sums them (a Keras op, not a layer, adds none)."""
  if not isinstance(layer, keras.Layer):
    return []
  return [keras.ops.sum(keras.ops.cast(loss, keras.config.floatx()))
          for loss in _internal.added_losses(layer)]


def _with_masks(tensor_names, tensors, names):
  """`tensor_names` and the mask names of those of `tensors` that have one."""
  masked = {names[id(t)] for t in tensors
            if _internal.get_keras_mask(t) is not None}
  return [n for name in tensor_names
          for n in ((name, name + _MASK) if name in masked else (name,))]


def _run_node(node, reads, writes, masked, values, training):
  """Runs `node`'s call on `values` (by name) as the model's call does:
  `reads` and `writes` name its input and output tensors, `masked` the
  masks it writes."""
  by_id = {}
  for t, name in zip(node.input_tensors, reads):
    if name + _MASK in values:
      _internal.set_keras_mask(values[name], values[name + _MASK])
    by_id[id(t)] = values[name]
  args, kwargs = node.arguments.fill_in(by_id)
  outputs = _internal.call_in_graph(node.operation, training)(*args, **kwargs)
  written = {}
  for name, value in zip(writes, keras.tree.flatten(outputs)):
    written[name] = value
    if name + _MASK in masked:
      written[name + _MASK] = _internal.get_keras_mask(value)
  return written


def _feed(model, graph, x):
  """The model's input `x` by name, converted as `model(x)` converts it."""
  if graph is not model:  # A Sequential converts its input, then runs its graph.
    x = keras.tree.map_structure(
        lambda t: model.dtype_policy.convert_input(
            t, model.autocast, model.input_dtype), x)
  flat = _internal.standardize_inputs(graph, x)
  return {f"input:{i}": t for i, t in enumerate(flat)}
