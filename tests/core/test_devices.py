"""Which devices a strategy uses: listing, validating, splitting the CPU.

conftest split the CPU into 4 logical devices; other device kinds are
simulated by replacing TensorFlow's device listing. On a machine with GPUs,
the real listing has them too.
"""

import re
import unittest
from unittest import mock

from parameterized import parameterized
import tensorflow as tf

from replicator_strategy import devices

TASK = "/job:localhost/replica:0/task:0"
CPU = TASK + "/device:CPU:%d"
GPU = TASK + "/device:GPU:%d"
TPU = TASK + "/device:TPU:%d"
ALL_CPUS = tuple(CPU % i for i in range(4))


def listing(*logical_devices):
  """Replaces `tf.config.list_logical_devices` with these (name, type) pairs."""
  fake = [tf.config.LogicalDevice(name, kind) for name, kind in logical_devices]
  return mock.patch.object(
      tf.config, "list_logical_devices",
      lambda device_type=None: [d for d in fake
                                if device_type in (None, d.device_type)])


class SplitCpuTest(unittest.TestCase):

  def test_the_same_split_again_is_harmless_and_another_says_why_not(self):
    tf.constant(1.0)  # TF devices exist now.
    devices.split_cpu(4)  # conftest's split: nothing to do.
    self.assertEqual(len(tf.config.list_logical_devices("CPU")), 4)
    with self.assertRaisesRegex(
        RuntimeError, r"split_cpu\(3\) was called after TensorFlow "
        r"initialised its devices, so the CPU stays split into 4 logical "
        r"device\(s\). Call split_cpu at the start of the program"):
      devices.split_cpu(3)

  @parameterized.expand([("zero", 0), ("negative", -1), ("float", 2.0),
                         ("string", "4"), ("none", None)])
  def test_the_count_must_be_a_positive_int(self, _, bad):
    with self.assertRaisesRegex(
        ValueError, r"^Expected `num_devices` to be a positive int. "
        r"Received: num_devices=" + re.escape(repr(bad)) + "$"):
      devices.split_cpu(bad)


class LocalDevicesTest(unittest.TestCase):

  def test_every_gpu_else_every_logical_cpu(self):
    gpus = len(tf.config.list_logical_devices("GPU"))
    self.assertEqual(devices.local_devices(),
                     tuple(GPU % i for i in range(gpus)) or ALL_CPUS)
    with listing(*((d, "CPU") for d in ALL_CPUS)):
      self.assertEqual(devices.local_devices(), ALL_CPUS)

  def test_gpus_when_there_are_any(self):
    with listing((CPU % 0, "CPU"), (GPU % 0, "GPU"), (GPU % 1, "GPU")):
      self.assertEqual(devices.local_devices(), (GPU % 0, GPU % 1))

  def test_only_this_workers_devices(self):
    # In a cluster TF lists every worker's devices; the others' are dropped.
    other = "/job:worker/replica:0/task:1/device:GPU:0"
    with listing((other, "GPU"), (CPU % 0, "CPU")):
      self.assertEqual(devices.local_devices(), (CPU % 0,))

  def test_no_device_at_all_says_so(self):
    with listing():
      with self.assertRaisesRegex(RuntimeError, "no CPU or GPU device"):
        devices.local_devices()

  def test_tpu_present(self):
    self.assertFalse(devices.tpu_present())
    with listing((CPU % 0, "CPU"), (TPU % 0, "TPU")):
      self.assertTrue(devices.tpu_present())


class ResolveDevicesTest(unittest.TestCase):

  @parameterized.expand([
      ("short", ["/cpu:2", "/cpu:0"]),
      ("no_slash", ["CPU:2", "cpu:0"]),
      ("device_prefix", ["/device:CPU:2", "/device:cpu:0"]),
      ("full", [CPU % 2, CPU % 0]),
      ("job_only", ["/job:localhost/device:CPU:2", "/job:localhost/cpu:0"]),
      ("device_specs", [tf.DeviceSpec(device_type="CPU", device_index=2),
                        tf.DeviceSpec.from_string("/job:localhost/cpu:0")]),
      ("tuple", ("/cpu:2", "/cpu:0")),
      ("generator", (f"/cpu:{i}" for i in (2, 0))),
  ])
  def test_any_spelling_gives_full_names_in_the_order_given(self, _, given):
    self.assertEqual(devices.resolve_devices(given), (CPU % 2, CPU % 0))

  @parameterized.expand([
      ("missing", ["/cpu:0", "/cpu:9"], r"^Device '/cpu:9' in `devices` does "
       "not exist on this machine"),
      ("gpu_absent", ["/gpu:9"], "'/gpu:9'.*does not exist"),
      ("other_worker", ["/job:worker/replica:0/task:1/cpu:0"],
       "'/job:worker/replica:0/task:1/cpu:0'.*does not exist"),
      ("duplicate", ["/cpu:1", "/device:CPU:1"], r"Device '/device:CPU:1' "
       r"appears more than once in `devices` \(as " + CPU % 1 + r"\). List "
       "each device once"),
      ("empty", [], r"^Expected `devices` to name at least one device. "
       r"Received: devices=\[\]"),
      ("garbage", ["not a device"], r"Device 'not a device' in `devices` is "
       "not a valid device string"),
      ("plain_string", "/cpu:0",
       r"list of device strings.*devices='/cpu:0'. A single device goes in a "
       r"list too: devices=\['/gpu:0'\]"),
      ("device_spec_alone", tf.DeviceSpec(device_type="CPU", device_index=0),
       "A single device goes in a list too"),
      ("number_alone", 0, "Received: devices=0"),
      ("ints", [0, 1], r"Device 0 in `devices` is a number.*'/gpu:0' or "
       r"'/cpu:0'"),
      ("none_entry", ["/cpu:0", None],
       r"device string such as '/gpu:0' or a tf.DeviceSpec. Received: "
       r"devices\[1\]=None of type NoneType"),
      ("bytes_entry", [b"/cpu:0"], r"Received: devices\[0\]=b'/cpu:0' of type "
       r"bytes"),
      ("empty_string", [""], "Device '' in `devices` names no single device: "
       "it has no device type"),
      ("wildcard", ["/cpu:*"], r"'/cpu:\*' in `devices` names no single "
       "device: it has no device index"),
      ("no_index", ["/cpu:0", "/cpu"], "'/cpu' in `devices` names no single "
       "device"),
      ("spec_without_index", [tf.DeviceSpec(device_type="CPU")],
       "names no single device: it has no device index"),
  ])
  def test_bad_lists_name_the_entry_and_what_exists(self, _, given, pattern):
    with self.assertRaisesRegex(ValueError, pattern) as raised:
      devices.resolve_devices(given)
    # TF lists this process's devices without its task: "/device:CPU:0".
    existing = sorted(TASK + d.name for d in tf.config.list_logical_devices())
    self.assertIn(CPU % 0, existing)
    self.assertTrue(str(raised.exception).endswith(
        "Devices that exist: " + ", ".join(existing)), str(raised.exception))

  def test_mixed_device_types_are_refused(self):
    with listing((CPU % 0, "CPU"), (GPU % 0, "GPU")):
      with self.assertRaisesRegex(
          ValueError, r"`devices` mixes device types \['CPU', 'GPU'\].*list "
          r"only GPUs or only CPUs"):
        devices.resolve_devices(["/cpu:0", "/gpu:0"])

  def test_gpus_alone_are_fine(self):
    with listing((CPU % 0, "CPU"), (GPU % 0, "GPU"), (GPU % 1, "GPU")):
      self.assertEqual(devices.resolve_devices(["/gpu:1", "/gpu:0"]),
                       (GPU % 1, GPU % 0))

  def test_tpus_are_recognised_and_not_supported(self):
    with listing((CPU % 0, "CPU"), (TPU % 0, "TPU")):
      with self.assertRaises(NotImplementedError) as raised:
        devices.resolve_devices(["/tpu:0"])
    self.assertEqual(str(raised.exception),
                     devices.tpu_not_supported_message())
    self.assertIn("tf.distribute.TPUStrategy", str(raised.exception))

  def test_other_device_types_are_refused(self):
    with listing((CPU % 0, "CPU"), (TASK + "/device:FPGA:0", "FPGA")):
      with self.assertRaisesRegex(
          ValueError, "Device '/device:FPGA:0' in `devices` has type FPGA; "
          "ReplicatorStrategy replicates over CPU or GPU devices"):
        devices.resolve_devices(["/device:FPGA:0"])


if __name__ == "__main__":
  unittest.main()
