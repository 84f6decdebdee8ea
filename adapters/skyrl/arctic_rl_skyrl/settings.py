"""The adapter's own settings, `trainer.arctic_rl.<name>=<value>` on SkyRL's command line.

SkyRL's strict config parse does not know them, so they are taken out of the overrides before it runs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PREFIX = "trainer.arctic_rl."
ENTRYPOINT_KEY = "trainer.override_entrypoint="
"""SkyRL's `main_base` reads it before its strict parse, which does not know it either."""


class ArcticSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    """The Arctic RL server (`arctic-rl serve`); also what `generator.inference_engine.external_proxy_url` names."""
    token_env: str = "ARCTIC_RL_TOKEN"
    """Environment variable holding the server's bearer token (needed off loopback)."""
    timeout_s: float = Field(600.0, gt=0)


def split_overrides(argv: list[str]) -> tuple[ArcticSettings, list[str]]:
    """Our settings and SkyRL's overrides, from SkyRL's command-line overrides."""
    ours: dict[str, str] = {}
    rest = []
    for arg in argv:
        if arg.startswith(ENTRYPOINT_KEY):
            continue
        if arg.startswith(PREFIX):
            key, sep, value = arg[len(PREFIX):].partition("=")
            if not sep:
                raise SystemExit(f"{arg}: write {PREFIX}<name>=<value>")
            ours[key] = value
        else:
            rest.append(arg)
    try:
        return ArcticSettings.model_validate(ours), rest
    except ValidationError as err:
        first = err.errors()[0]
        name = PREFIX + ".".join(str(part) for part in first["loc"])
        raise SystemExit(f"{name}: {first['msg']} (known: {', '.join(ArcticSettings.model_fields)})") from None
