"""What a `[providers.<name>]` table may contain."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator


class _Provider(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    display_name: str = Field(min_length=1, max_length=80)


class ApiKeyValidation(BaseModel):
    """An optional probe: the key is valid when this request answers 2xx."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    method: Literal["GET", "POST", "HEAD"] = "GET"
    header: str = "Authorization: Bearer {api_key}"
    timeout_seconds: float = Field(default=5, gt=0, le=30)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.match(r"^https?://[^\s/?#@]+(/[^\s#]*)?$", value):
            raise ValueError("must be an absolute http(s) URL without user info")
        return value

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        name, sep, template = value.partition(":")
        if not sep or not re.fullmatch(r"[A-Za-z0-9-]+", name.strip()):
            raise ValueError('must look like "Header-Name: template with {api_key}"')
        if template.count("{api_key}") != 1:
            raise ValueError("the template must contain {api_key} exactly once")
        return value


class ApiKeyProviderSettings(_Provider):
    kind: Literal["api_key"]
    label: str = Field(default="API key", min_length=1, max_length=80)
    help_url: str | None = None
    pattern: str = r"^\S{8,512}$"
    validation: ApiKeyValidation | None = None

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value

    @field_validator("help_url")
    @classmethod
    def _help_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://\S+$", value):
            raise ValueError("must be an absolute http(s) URL")
        return value


ProviderSettings = ApiKeyProviderSettings
provider_settings_adapter: TypeAdapter[ProviderSettings] = TypeAdapter(ProviderSettings)
