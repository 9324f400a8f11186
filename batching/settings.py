"""Process settings from the environment (prefix ``CONVEYOR_``), one typed object passed in."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    model_repository: Path = Path("./models")
    key_prefix: str = "cv"
    models: str = ""
    """Comma-separated model names to serve; empty serves every model in the repository."""
    heartbeat_interval_s: float = 1.0
    heartbeat_stale_s: float = 5.0
    """A worker heartbeat older than this no longer counts for readiness."""
    http_port: int = 8000
    grpc_port: int = 8001
    flower_port: int = 5555
    worker_port: int = 8002
    """The inference worker's probe port (/live, /ready); 0 turns the probe off."""

    def model_filter(self) -> set[str]:
        return {m.strip() for m in self.models.split(",") if m.strip()}
