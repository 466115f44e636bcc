"""The course's labs: each lab's name (its notebook's stem) and its graded tasks."""

from kernels.grader import lab01, lab02, lab03

LABS = {lab01.NAME: lab01.TASKS, lab02.NAME: lab02.TASKS, lab03.NAME: lab03.TASKS}
