"""`keras.distribution.initialize()` forms the cluster a ReplicatorStrategy joins.

Two workers on 127.0.0.1, started by the launcher, each turn the TF_CONFIG
it gives them into Keras's `KERAS_DISTRIBUTION_*` variables (as a JAX
launch script sets them) and unset it; `keras.distribution.initialize()`
then writes the cluster back for TensorFlow, and the ReplicatorStrategy that
`set_distribution(DataParallel(...))` makes afterwards spans both workers (2
logical CPUs each): `fit` on NumPy input (which Keras alone refuses across
processes) and on a `tf.data` dataset of global batches trains as one
process with 4 replicas does, and
`distribute_data_input` hands each worker's replicas that worker's rows.
Bounded by the launcher's timeout, which stops every worker.
"""

import pathlib
import sys
import tempfile
import unittest

import numpy as np
import pytest

import test_multi_worker

TESTS = pathlib.Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, pathlib, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tests = pathlib.Path(sys.argv[1])
sys.path[1:1] = [str(tests)] + sorted(
    str(d) for d in tests.iterdir() if d.is_dir() and d.name[0] not in "._")
cluster = json.loads(os.environ.pop("TF_CONFIG"))  # The launcher's.
os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"] = ",".join(
    cluster["cluster"]["worker"])
os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"] = str(
    len(cluster["cluster"]["worker"]))
os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] = str(cluster["task"]["index"])

import replicator_strategy as rs
rs.split_cpu(2)
rs.use_for_keras_distribution()
import keras
import tensorflow as tf
from keras.src.backend import distribution_lib as backend
keras.distribution.initialize()
distribution = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
keras.distribution.set_distribution(distribution)
strategy = tf.distribute.get_strategy()

import multi_worker_runs
import numpy as np
index = strategy.extended.cluster.worker_index
with strategy.scope():
  rows = backend.distribute_data_input(
      np.arange(8).reshape(4, 2) + 100 * index, None, "batch")
results = {
    "data_input": [p.numpy().tolist()
                   for p in strategy.experimental_local_results(rows)],
    "tf_config_written": json.loads(os.environ["TF_CONFIG"]) == cluster,
    "workers": strategy.extended.cluster.num_workers,
    "process": [distribution.num_processes, backend.process_id()],
    "keras_fit": multi_worker_runs.keras_fit(strategy),
}
# The same rows as a tf.data dataset of global batches: split once, by the
# strategy (Keras alone would cut each worker's part again).
x, y = multi_worker_runs.data()
model = multi_worker_runs._model(
    strategy, lambda: keras.optimizers.Adam(0.01), loss="mse")
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(
    multi_worker_runs.GLOBAL_BATCH), epochs=3, verbose=0)
results["dataset_fit"] = multi_worker_runs._weights(model)
pathlib.Path(sys.argv[2], f"worker_{index}.json").write_text(
    json.dumps(results))
"""


@pytest.mark.slow  # Two worker processes, each starting TensorFlow.
class InitializeTwoWorkersTest(unittest.TestCase):

  def test_workers_joined_by_initialize_train_as_one_process(self):
    with tempfile.TemporaryDirectory() as out:
      status, output = test_multi_worker.launch_workers(
          runs=(), out=out, command=(sys.executable, "-c", WORKER, str(TESTS),
                                     out))
      workers = test_multi_worker.worker_results(out, status, output)
    reference = test_multi_worker.in_one_process("keras_fit")
    for index, worker in enumerate(workers):
      with self.subTest(worker=index):
        self.assertTrue(worker["tf_config_written"])
        self.assertEqual(worker["workers"], 2)
        self.assertEqual(worker["process"], [2, index])
        # distribute_data_input: this worker's rows, 2 to each of its replicas.
        rows = (np.arange(8).reshape(4, 2) + 100 * index).tolist()
        self.assertEqual(worker["data_input"], [rows[:2], rows[2:]])
        test_multi_worker.assert_close_nested(
            self, worker["keras_fit"], reference)
        test_multi_worker.assert_close_nested(
            self, worker["dataset_fit"], reference["weights"])


if __name__ == "__main__":
  unittest.main()
