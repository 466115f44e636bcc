"""The course's labs: each lab's name (its notebook's stem) and its graded tasks."""

from kernels.grader import lab01, lab02, lab03, lab04, lab05, lab06, lab07

LABS = {lab.NAME: lab.TASKS for lab in (lab01, lab02, lab03, lab04, lab05, lab06, lab07)}
