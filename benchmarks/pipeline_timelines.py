"""Draws each pipeline schedule's per-device timeline: measured and simulated.

    python -m benchmarks.pipeline_timelines [--out docs/pipeline]
        [--stages 4] [--microbatches 8] [--quick]

For each schedule, one step of the `pipeline` section's MLP (S stages, 2 a
device of half the layers for interleaved 1F1B) on S logical CPU devices, traced by TF's
profiler (`benchmarks.pipeline_trace`), is drawn above the schedule's
simulated timeline (F, B and W one unit each; an unsplit B two): a row per
device, a box per action (F, B, W), its micro-batch written in it. Writes
`<out>/<schedule>.png`. On a machine with fewer cores than devices the
measured boxes take turns across the devices (see the section's table).
"""

import argparse
import os
import sys

import replicator_strategy as rs

COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def draw(measured, path, title):
  """Writes the measured timeline over the simulated one to `path` (PNG)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  from replicator_strategy.pipeline import schedules  # pylint: disable=g-import-not-at-top

  plan = measured.plan
  simulated = schedules.timeline(plan)
  figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(10, 4.2), dpi=80)
  panels = (
      (top, {a: (s / 1e3, e / 1e3) for a, (s, e) in measured.spans.items()},
       f"measured, ms (bubble {measured.bubble():.2f}, devices busy at once "
       f"{measured.parallelism():.2f})"),
      (bottom, {a: (simulated.start[a], simulated.end[a])
                for a in simulated.start},
       f"simulated, units (bubble {schedules.bubble_fraction(plan):.2f})"))
  for axes, spans, label in panels:
    for action, (start, end) in spans.items():
      device = plan.device_of(action.stage)
      axes.barh(device, end - start, left=start, height=0.8,
                color=COLORS[action.kind], edgecolor="white", linewidth=0.5)
      text = (f"{action.micro}" if plan.stages == len(plan)
              else f"{action.stage // len(plan)}.{action.micro}")
      axes.text((start + end) / 2, device, text, ha="center", va="center",
                fontsize=6, color="white", clip_on=True)
    axes.set_yticks(range(len(plan)), [f"dev {d}" for d in range(len(plan))])
    axes.invert_yaxis()
    axes.set_title(label, fontsize=8, loc="left")
    axes.tick_params(labelsize=7)
  handles = [matplotlib.patches.Patch(color=c, label=k)
             for k, c in COLORS.items() if k != "W" or plan.split_backward]
  figure.legend(handles=handles, fontsize=7, loc="upper right", ncol=3)
  figure.suptitle(title, fontsize=9)
  figure.tight_layout()
  figure.savefig(path, pil_kwargs={"optimize": True})
  pyplot.close(figure)


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.pipeline_timelines",
      description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="docs/pipeline")
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--microbatches", type=int, default=8)
  parser.add_argument("--quick", action="store_true",
                      help="the section's --quick MLP (tiny)")
  args = parser.parse_args(argv)
  rs.split_cpu(args.stages)  # Before TensorFlow starts.
  from benchmarks import options as options_lib  # pylint: disable=g-import-not-at-top
  from benchmarks.sections import pipeline  # pylint: disable=g-import-not-at-top

  size = options_lib.Options(quick=args.quick).size
  os.makedirs(args.out, exist_ok=True)
  rows, width, layers = size["pipeline_mlp"]
  for name in pipeline.SCHEDULES:
    virtual = pipeline.VIRTUAL if name == "interleaved_1f1b" else 1
    measured = pipeline.measured_run(size, name, args.stages,
                                     args.microbatches, virtual)
    path = os.path.join(args.out, f"{name}.png")
    draw(measured, path,
         f"{name}{f' (v={virtual})' if virtual > 1 else ''}: S={args.stages}, "
         f"M={args.microbatches}; MLP of Dense({width}) x {layers} a device, "
         f"batch {rows}, on {os.cpu_count()} CPU cores")
    print(path, f"measured bubble {measured.bubble():.3f}")


if __name__ == "__main__":
  sys.exit(main())
