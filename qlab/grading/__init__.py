"""Exercises and autograding: learner-side ``check`` and the ``qlab grade`` machinery.

    from qlab.grading import check
    check("sym_quantize", symmetric_quantize)   # fresh random inputs vs qlab

See README.md in this folder for the task registry and how to add a task.
"""

from qlab.grading.check import CheckFailed, check
from qlab.grading.registry import (
    Task,
    all_tasks,
    assignment_tasks,
    assignments,
    close,
    exact,
    get_task,
    register,
)

__all__ = [
    "check",
    "CheckFailed",
    "Task",
    "register",
    "get_task",
    "all_tasks",
    "assignments",
    "assignment_tasks",
    "exact",
    "close",
]
