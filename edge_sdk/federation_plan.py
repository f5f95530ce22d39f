"""The federation's training plan as the coordinator set it at provisioning (site config ``federation_plan``).

Before a gateway has trained its first round it knows nothing of the noise its records will face; the learnability
report (``wildfed-edge check-config``, :mod:`edge_sdk.field.training_report`) then calibrates a plan itself. When
the coordinator wrote the plan into the site's ``site.yaml`` at provisioning (``wildfed-coordinator provision``:
its ``rounds``, ``local_steps``, ``expected_batch_size``, budgets, ``target_delta``, ``clipping_norm``,
``ccdp_variant`` and the site's declared ``capacity``), the report uses that instead of assumptions. Public values only: the same numbers every task
carries. After the first round, the plan that ran is used (``<state>/last-plan.json``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FederationPlan"]


class FederationPlan(BaseModel):
    """The coordinator's plan (module docstring).

    Attributes:
        rounds: rounds each record trains. local_steps: DP-SGD steps per round. expected_batch: records per step in
        expectation (the coordinator's ``expected_batch_size``). budgets: epsilon per IUCN category code (``CR``,
        ..., ``NE``). target_delta: the delta of every guarantee. clipping_norm: L2 norm C. variant: individualized
        DP-SGD as ``sample`` (per-category sampling rates) or ``scale`` (per-category clipping norms). capacity: the
        site's declared capacity N_k (its enrolment metadata), by which the rounds divide the expected batch for the
        sampling rate (``edge_sdk.training``); None when it declared none (the report then uses the records held).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rounds: int = Field(ge=1)
    local_steps: int = Field(ge=1)
    expected_batch: int = Field(ge=1)
    budgets: dict[Literal["CR", "EN", "VU", "NT", "LC", "NE"], float]
    target_delta: float = Field(gt=0, lt=1)
    clipping_norm: float = Field(gt=0)
    variant: Literal["sample", "scale"] = "sample"
    capacity: int | None = Field(None, ge=1)
