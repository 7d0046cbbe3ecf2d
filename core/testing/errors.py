"""The one failure type of the plugin checks."""

from __future__ import annotations


class PluginCheckError(AssertionError):
    """A plugin breaks the host's contract: ``check_<kind>(<plugin>): <step>: <problem>. <fix>``."""

    def __init__(self, check: str, plugin: str, step: str, problem: str, fix: str = "") -> None:
        self.check, self.plugin, self.step = check, plugin, step
        super().__init__(f"{check}({plugin}): {step}: {problem}" + (f". {fix}" if fix else ""))
