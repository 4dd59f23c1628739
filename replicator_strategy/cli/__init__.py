"""Command-line tools: the launcher, the environment report, quiet logs.

Owns `replicator-launch` (`launch`: N local workers, each with its own
`TF_CONFIG`; `worker_output` relays their lines), `replicator-env` and
`python -m replicator_strategy` (`environment_report`), and keeping
TensorFlow's start-up INFO lines out (`tensorflow_logs`). `launch`,
`worker_output` and `tensorflow_logs` import no TensorFlow.

May import: anything in the package but `keras`, lazily where a command
must start without TensorFlow.
"""
