"""ReplicatorStrategy vs MirroredStrategy vs no strategy, side by side.

    python -m benchmarks                    # the full run
    python -m benchmarks --quick            # tiny sizes: runs and agrees
    python -m benchmarks --json out.json    # the results as JSON too
    python -m benchmarks --sections fit,update

This package owns the benchmark behind docs/performance.md: its command line
(`cli`, `options`), the contenders and their devices (`contenders`), the
models and data they share (`models`), timing, process and table helpers
(`timing`, `processes`, `tables`), and one module per section under
`sections/`, each declared once in `sections.REGISTRY` (its name, what it
measures, how it runs, its table). It imports `replicator_strategy`, never
the other way round, and does no work at import: flags are read and the CPU
is split into logical devices in `cli.main`.

To add a section: a module under `sections/` whose docstring says what it
measures, declaring `SECTION = section.Section(...)`, listed once in
`sections.REGISTRY`; `--sections`, `--help`, the child processes, the JSON
and the tables all follow from that entry.

For each replica count, every contender runs in the same process on the
same logical devices (the CPU split into 4 unless GPUs exist), interleaved
round by round so that machine noise hits all of them alike; the tables
show medians and ratios. (Each replica count gets its own process:
MirroredStrategy's collective keys clash between instances over different
device counts.) Every contender starts from the same weights and data; the
run also checks that their losses and collective results agree ("agree").
"""
