"""The registry: every section, once, in the order its table prints.

Each module here measures one thing and declares it as `SECTION` (see
`benchmarks.section.Section`); `--sections` names them.
"""

from benchmarks.sections import allreduce
from benchmarks.sections import custom
from benchmarks.sections import embedding
from benchmarks.sections import exchange
from benchmarks.sections import first
from benchmarks.sections import fit
from benchmarks.sections import links
from benchmarks.sections import mapgather
from benchmarks.sections import memory
from benchmarks.sections import model_parallel
from benchmarks.sections import multi
from benchmarks.sections import overhead
from benchmarks.sections import parts
from benchmarks.sections import pipeline
from benchmarks.sections import random
from benchmarks.sections import reducescatter
from benchmarks.sections import sharding
from benchmarks.sections import sync_groups
from benchmarks.sections import update
from benchmarks.sections import xla

REGISTRY = {s.name: s for s in (
    fit.SECTION, custom.SECTION, xla.SECTION, random.SECTION,
    overhead.SECTION, parts.SECTION, update.SECTION, sharding.SECTION,
    embedding.SECTION, allreduce.SECTION, reducescatter.SECTION,
    mapgather.SECTION, first.SECTION, multi.SECTION, exchange.SECTION,
    model_parallel.SECTION, sync_groups.SECTION, links.SECTION,
    pipeline.SECTION, memory.SECTION)}
