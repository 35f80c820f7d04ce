"""Schedules written for costs (auto, auto-v): the synthesizer (synthesize), its list scheduler over integer
actions (list_scheduler) and the exact makespan of those plans without building them (fast_simulate)."""
