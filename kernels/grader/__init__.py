"""The labs' grader: `python -m kernels grade PATH...`, `python -m kernels progress`.

Trust model: the learner's code is untrusted. The grader's process reads the notebook's
`graded` cells (`submission`), checks their source statically (`static_checks`), and runs each
task in a fresh child process (`child`, started by `runner`) that imports that source from a
file and calls the learner's function on inputs the grader drew. The grader computes every
reference and makes every comparison itself (`tasks`, with `kernels.check`); it never imports
the learner's code. Each lab (`lab01` ... `lab05`, listed in `labs`) declares its tasks with the
case kit (`cases`). Starter notebooks: `starters`.
"""
