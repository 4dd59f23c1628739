"""Every kind of parallelism with every other: the composition matrix.

Each feature is one axis of the mesh or one option; each pair of them (and
each alone) trains a small MLP with `fit` on 4 logical CPUs, data parallel
over what the mesh leaves to the batch axis, and must equal one device
(same data, global batch and seed) or be refused with an error that names
both. docs/parallelism.md's table is this test's record: a case whose
outcome differs from its cell fails, so the table cannot go stale.
Rewrite it after a change with

    python tests/end_to_end/test_composition.py --write
"""

import dataclasses
import itertools
import pathlib
import re
import sys
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest

import replicator_strategy as rs

DOC = pathlib.Path(__file__).parents[2] / "docs" / "parallelism.md"
BEGIN, END = "<!-- composition: begin -->", "<!-- composition: end -->"
DEVICES = 4
ROWS, BATCH = 64, 16


@dataclasses.dataclass(frozen=True)
class Feature:
  """One kind of parallelism or one option, as a user turns it on."""
  name: str
  keywords: tuple  # Words a refusal naming this feature says.
  strategy: dict = dataclasses.field(default_factory=dict)
  sharding: dict = dataclasses.field(default_factory=dict)  # rs.Sharding's.
  groups: int = 1  # The mesh's group axis.
  model: int = 1  # The mesh's model axis.
  stages: int = 1  # The mesh's stage axis (a pipeline's).
  compile: dict = dataclasses.field(default_factory=dict)
  accumulation: int = None
  policy: str = None
  tolerance: tuple = (1e-5, 1e-6)  # rtol, atol.


FEATURES = (
    Feature("sharded state", ("shard_optimizer_state", "sharded state"),
            sharding={"optimizer_state": True}),
    Feature("ZeRO-3", ("variable_partitioner", "ZeRO-3", "sharded weights"),
            sharding={"weights": "batch"}),
    Feature("tensor parallel", ("layout_map", "devices_per_replica",
                                "tensor parallel", "model parallel"), model=2),
    Feature("sync groups", ("sync_groups", "sync groups"), groups=2),
    Feature("pipeline", ("pipeline", "stage"),
            strategy={"pipeline": rs.Pipeline(stages=2, microbatches=2)},
            stages=2),
    Feature("accumulation", ("gradient_accumulation_steps", "accumulat"),
            accumulation=2),
    Feature("compression", ("gradient_compression", "compression"),
            strategy={"gradient_compression": "float16"},
            tolerance=(1e-3, 1e-3)),
    Feature("mixed precision", ("mixed_float16", "mixed precision"),
            policy="mixed_float16", tolerance=(1e-3, 1e-3)),
    Feature("XLA", ("jit_compile", "XLA"), compile={"jit_compile": True}),
)
BY_NAME = {f.name: f for f in FEATURES}
CASES = [(a.name,) for a in FEATURES] + [
    (a.name, b.name) for a, b in itertools.combinations(FEATURES, 2)]


def case_name(names):
  return " x ".join(names)


def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, 8)).astype(np.float32),
          rng.normal(size=(ROWS, 4)).astype(np.float32))


def mlp(features):
  """Sync groups train with SGD (at one step a round, the mean of the
  groups' SGD steps is the synchronous step); the rest with Adam."""
  keras.utils.set_random_seed(3)
  model = keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(16, activation="tanh", name="up"),
      keras.layers.Dense(4, name="down"),
  ], name="mlp")  # Named as a refusal names it, whatever was built before.
  optimizer_class = (keras.optimizers.SGD
                     if any(f.groups > 1 for f in features) else
                     keras.optimizers.Adam)
  accumulation = [f.accumulation for f in features if f.accumulation]
  optimizer = optimizer_class(
      0.05, gradient_accumulation_steps=accumulation[0] if accumulation else None)
  compile_options = {}
  for f in features:
    compile_options.update(f.compile)
  model.compile(optimizer, "mse", **compile_options)
  return model


def strategy_for(features):
  """The strategy a user turns `features` on with, through its mesh."""
  groups = max(f.groups for f in features)
  model = max(f.model for f in features)
  stages = max(f.stages for f in features)
  batch = DEVICES // (groups * stages * model)
  devices = keras.distribution.list_devices()[:DEVICES]
  kwargs, sharding = {}, {}
  for f in features:
    kwargs.update(f.strategy)
    sharding.update(f.sharding)
  if sharding:
    kwargs["sharding"] = rs.Sharding(**sharding)
  if model > 1:  # A row of its mesh a replica's (stage's) devices.
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
        (groups * batch * stages, model), ("batch", "model"), devices))
    layout_map[".*up/kernel"] = (None, "model")  # Megatron's column and row.
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    kwargs["layout_map"] = layout_map
  axes = [("group", groups), ("batch", batch), ("stage", stages),
          ("model", model)]
  axes = [(name, size) for name, size in axes
          if size > 1 or name in ("batch", "model")]
  mesh = keras.distribution.DeviceMesh(
      tuple(size for _, size in axes), tuple(name for name, _ in axes),
      devices)
  return rs.ReplicatorStrategy(mesh=mesh, **kwargs)


def trained_weights(features, strategy=None):
  policy = [f.policy for f in features if f.policy]
  keras.mixed_precision.set_global_policy(policy[0] if policy else "float32")
  try:
    with strategy.scope() if strategy else _no_scope():
      model = mlp(features)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()
  finally:
    keras.mixed_precision.set_global_policy("float32")


class _no_scope:

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


_REFERENCES = {}


def reference_weights(features):
  """One device's weights, for the options that change its arithmetic."""
  key = (any(f.groups > 1 for f in features),
         tuple(sorted(f.name for f in features
                      if f.accumulation or f.policy or f.compile)))
  if key not in _REFERENCES:
    kept = [f for f in features if f.accumulation or f.policy or f.compile]
    if key[0]:
      kept.append(BY_NAME["sync groups"])  # Its SGD; no strategy here.
    _REFERENCES[key] = trained_weights(kept)
  return _REFERENCES[key]


def outcome(names):
  """("equal", None), or ("refused", the error's message)."""
  features = [BY_NAME[n] for n in names]
  try:
    strategy = strategy_for(features)
    weights = trained_weights(features, strategy)
  except (NotImplementedError, ValueError) as e:
    return "refused", str(e).split("\n")[0]
  expected = reference_weights(features)
  rtol, atol = max(f.tolerance for f in features)
  for got, want in zip(weights, expected):
    np.testing.assert_allclose(
        got, want, rtol=rtol, atol=atol,
        err_msg=f"{case_name(names)} trains, but not as one device does")
  return "equal", None


def table(outcomes):
  """The doc's section: the matrix, then each refusal's message."""
  names = [f.name for f in FEATURES]
  lines = ["| | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
  for a in names:
    cells = []
    for b in names:
      key = (a,) if a == b else tuple(n for n in names if n in (a, b))
      cells.append("equal" if outcomes[key][0] == "equal" else "refused")
    lines.append(f"| **{a}** | " + " | ".join(cells) + " |")
  refusals = [f"- {case_name(key)}: {message}"
              for key, (status, message) in outcomes.items()
              if status == "refused"]
  lines += ["", "Refused:" if refusals else "Nothing is refused.", ""]
  lines += refusals
  return "\n".join(lines)


def documented():
  text = DOC.read_text()
  return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


@pytest.mark.slow
class CompositionTest(unittest.TestCase):

  def assert_cell(self, section, names, expected):
    header, *rows = [line for line in section.splitlines()
                     if line.startswith("| ")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    for a, b in ((names[0], names[-1]), (names[-1], names[0])):
      row = next(r for r in rows if r.startswith(f"| **{a}** |"))
      cells = [c.strip() for c in row.strip("|").split("|")]
      self.assertEqual(cells[columns.index(b)], expected,
                       f"docs/parallelism.md's cell {a} x {b} is stale: "
                       f"rewrite it with python "
                       f"tests/end_to_end/test_composition.py --write")

  @parameterized.expand(CASES, name_func=lambda f, n, p: (
      f"{f.__name__}_{n}_" + "_x_".join(
          re.sub(r"\W+", "_", name) for name in p.args)))
  def test_trains_as_one_device_or_is_refused_as_documented(self, *names):
    status, message = outcome(names)
    section = documented()
    self.assert_cell(section, names, status)
    if status == "refused":
      for name in names:
        self.assertTrue(
            any(k.lower() in message.lower() for k in BY_NAME[name].keywords),
            f"The refusal of {case_name(names)} does not name {name}: "
            f"{message}")
      self.assertIn(f"- {case_name(names)}: {message}", section,
                    "docs/parallelism.md is stale: rewrite it with "
                    "python tests/end_to_end/test_composition.py --write")
    else:
      self.assertNotIn(f"- {case_name(names)}:", section,
                       f"{case_name(names)} now composes; docs/parallelism.md "
                       f"still lists it as refused: rewrite it with "
                       f"python tests/end_to_end/test_composition.py --write")


def write():
  """Runs every case and rewrites docs/parallelism.md's table."""
  rs.split_cpu(DEVICES)
  outcomes = {names: outcome(names) for names in CASES}
  text = DOC.read_text()
  start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
  DOC.write_text(text[:start] + "\n" + table(outcomes) + "\n" + text[end:])
  print(table(outcomes))


if __name__ == "__main__":
  if sys.argv[1:] == ["--write"]:
    write()
  else:
    unittest.main()
