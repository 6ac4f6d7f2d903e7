"""What the Kubernetes Job controller and the JobSet controller do with a failed pod, for tests that
have no cluster: which pod failures count against a Job's backoffLimit, when the Job fails and with
what reason and message, and what a JobSet's failurePolicy then does.

Ported from the controllers' code, not from a reading of the docs:
- kubernetes pkg/controller/job/pod_failure_policy.go, matchPodFailurePolicy: rules in order, the
  first match wins; onExitCodes never matches exit code 0; FailJob's message names the exit code or
  the condition; no match counts the failure;
- kubernetes pkg/controller/job/job_controller.go: the Job fails once failed > backoffLimit (reason
  BackoffLimitExceeded), or at once on a FailJob rule (reason PodFailurePolicy);
- jobset pkg/controllers/failure_policy.go: rules in order, a rule matches when the reason is in
  onJobFailureReasons and a pattern of onJobFailureMessagePatterns matches the message (an empty
  list matches anything); no match means RestartJobSet; restarts count towards maxRestarts unless
  the action ends in AndIgnoreMaxRestarts, and a restart past maxRestarts fails the JobSet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodFailure:
    """A pod of the Job that ended in phase Failed."""

    name: str
    exit_code: int  # of the container named `container`
    conditions: tuple[str, ...] = ()  # pod condition types with status "True", e.g. DisruptionTarget
    container: str = "ddpjob"
    namespace: str = "default"


def match_pod_failure_policy(policy: dict | None, pod: PodFailure) -> tuple[str | None, bool]:
    """(the Job's failure message if a FailJob rule matched, whether the failure counts)."""
    for index, rule in enumerate((policy or {}).get("rules", [])):
        action = rule["action"]
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            if req.get("containerName", pod.container) != pod.container or pod.exit_code == 0:
                continue
            listed = pod.exit_code in req["values"]
            if listed != (req["operator"] == "In"):
                continue
            what = f"Container {pod.container} for pod {pod.namespace}/{pod.name} failed with exit code {pod.exit_code}"
        elif "onPodConditions" in rule:
            matched = [
                c["type"] for c in rule["onPodConditions"] if c["status"] == "True" and c["type"] in pod.conditions
            ]
            if not matched:
                continue
            what = f"Pod {pod.namespace}/{pod.name} has condition {matched[0]}"
        else:
            continue
        if action == "Ignore":
            return None, False
        if action == "FailJob":
            return f"{what} matching FailJob rule at index {index}", True
        return None, True  # Count (FailIndex needs backoffLimitPerIndex, which these Jobs do not use)
    return None, True


@dataclass
class Job:
    """A batch/v1 Job's failure bookkeeping: `failed` counts towards backoffLimit."""

    spec: dict
    failed: int = 0
    ignored: int = 0
    condition: tuple[str, str] | None = None  # (reason, message) of its Failed condition

    def pod_failed(self, pod: PodFailure) -> None:
        message, counts = match_pod_failure_policy(self.spec.get("podFailurePolicy"), pod)
        self.failed += counts
        self.ignored += not counts
        if self.condition:
            return
        if message:
            self.condition = ("PodFailurePolicy", message)
        elif self.failed > self.spec.get("backoffLimit", 6):
            self.condition = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")


@dataclass
class JobSet:
    """A JobSet's failurePolicy applied to its child Jobs' failures."""

    spec: dict
    restarts: int = 0  # all of them
    counted: int = 0  # those that count towards maxRestarts
    failed: bool = False
    actions: list[str] = field(default_factory=list)

    def child_failed(self, reason: str, message: str) -> str:
        policy = self.spec.get("failurePolicy", {})
        action = next(
            (
                r["action"]
                for r in policy.get("rules", [])
                if (not r.get("onJobFailureReasons") or reason in r["onJobFailureReasons"])
                and (
                    not r.get("onJobFailureMessagePatterns")
                    or any(re.search(p, message) for p in r["onJobFailureMessagePatterns"])
                )
            ),
            "RestartJobSet",
        )
        self.actions.append(action)
        if action == "FailJobSet":
            self.failed = True
        elif action.endswith("AndIgnoreMaxRestarts"):
            self.restarts += 1
        elif self.counted >= policy.get("maxRestarts", 0):
            self.failed = True
        else:
            self.restarts += 1
            self.counted += 1
        return action
