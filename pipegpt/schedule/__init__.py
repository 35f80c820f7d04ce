"""Schedules as data: pure Python, no torch (so `pipegpt simulate` starts instantly)."""
from .actions import Action, Composite, Kind, Plan, PlanError, ScheduleError
from .lowering import (add_reduce_grad, add_unshard_reshard, last_gradient_actions, lower, without_reduce_grad,
                       without_unshard_reshard)
from .registry import SCHEDULES, ScheduleSpec, build_plan, schedule_spec
from .validate import validate

__all__ = ["Action", "Composite", "Kind", "Plan", "PlanError", "ScheduleError", "SCHEDULES", "ScheduleSpec",
           "add_reduce_grad", "add_unshard_reshard", "build_plan", "last_gradient_actions", "lower", "schedule_spec",
           "validate", "without_reduce_grad", "without_unshard_reshard"]
