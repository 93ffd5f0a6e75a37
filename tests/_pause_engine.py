"""A stand-in engine for the pause tests: it records the manager's pause and continue calls
(``log``) and its generation state (``paused``: the pause mode, None while generating); nothing
else runs. Subclasses add what their test drives (service state, adapter loads, failures)."""

from __future__ import annotations


class PauseEngine:
    base_url = "http://127.0.0.1:39999"

    def __init__(self):
        self.paused, self.log = None, []

    def get_weight_version(self):
        return "default"

    def pause_generation(self, mode="abort"):
        self.paused = mode
        self.log.append(("pause", mode))

    def continue_generation(self):
        self.paused = None
        self.log.append(("continue",))

    def set_serving(self, serving, reason=""):
        pass
