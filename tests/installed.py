"""Installing a job's settings at the aggregation service, as the coordinator does before a job's model and rounds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedbroker.job.settings import sections_settings
from fedbroker.rpc.aggregation_client import AggregatorClient


def install(client: AggregatorClient, job_id: str, aggregation: Mapping[str, Any] | None = None) -> str:
    """Install the job with this aggregation section (every other setting its default); the digest held."""
    return client.install_job(sections_settings(job_id, aggregation=aggregation))
