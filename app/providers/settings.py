"""What a `[providers.<name>]` table may contain."""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.display import display_text
from app.urls import is_loopback_host


class _Provider(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    display_name: str = Field(min_length=1, max_length=80)

    @field_validator("display_name", "label", check_fields=False)
    @classmethod
    def _shown_as_is(cls, value: str) -> str:
        """Names pages show: no invisible characters that would change what they seem to say."""
        return display_text(value)


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
        if value.startswith("http://") and not _is_loopback(value):  # the key travels in it
            raise ValueError("must use https (http is allowed only for loopback hosts)")
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


PresetName = Literal[
    "github", "gitlab", "google", "slack", "microsoft", "atlassian", "linear", "notion"
]
# One RFC 6749 §3.3 scope-token (printable ASCII but space, `"` and `\\`), less the comma some
# providers separate scopes with: a value holding a separator would ask for several scopes.
SCOPE_PATTERN = r"^[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]{1,256}$"
_SCOPE_PATTERN = re.compile(SCOPE_PATTERN)


def is_scope_token(value: str, separator: str = " ") -> bool:
    """True for one scope, as the provider's `scope_separator` would keep it apart."""
    return bool(_SCOPE_PATTERN.fullmatch(value)) and separator not in value


HTTP_URL = re.compile(r"^https?://[^\s/?#@]+(/[^\s#]*)?$")


def _is_loopback(url: str) -> bool:
    return is_loopback_host(urlsplit(url).hostname or "")


class OAuthProviderSettings(_Provider):
    """An OAuth 2.0 authorization server (`oauth2`) or an OpenID provider (`oidc`)."""

    kind: Literal["oauth2", "oidc"]
    preset: PresetName | None = None
    client_id: str = Field(min_length=1)
    client_secret: SecretStr = SecretStr("")
    authorize_url: str | None = None  # oidc: discovered from the issuer when omitted
    token_url: str | None = None
    userinfo_url: str | None = None
    revocation_url: str | None = None
    revocation: Literal["rfc7009", "github", "none"] = "rfc7009"
    issuer: str | None = None
    api_base_url: str | None = None
    scopes: tuple[str, ...] = Field(default=(), validate_default=True)
    scope_separator: str = " "
    scope_parameter: str = Field(default="scope", pattern=r"^[a-z_]{1,32}$")  # Slack: user_scope
    pkce: bool = True
    client_auth_method: Literal["client_secret_basic", "client_secret_post"] = "client_secret_post"
    account_label_claim: str | None = None
    account_label_prefix: str = ""
    # member (dotted) of the same document holding the account's identity at the provider; an
    # OpenID provider without it uses the ID token's `sub`
    account_id_claim: str | None = None
    authorize_params: dict[str, str] = Field(default_factory=dict)
    token_types: tuple[str, ...] = ("bearer",)  # accepted `token_type`s, compared lower-case
    # The token response's member holding the token fields, when not the response itself (Slack's
    # user token: `authed_user`); a response without it (a refresh) is read at the top level.
    token_member: str | None = Field(default=None, pattern=r"^[a-z_]{1,32}$")
    timeout_seconds: float = Field(default=10, gt=0, le=60)

    @field_validator(
        "authorize_url", "token_url", "userinfo_url", "revocation_url", "issuer", "api_base_url"
    )
    @classmethod
    def _urls(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not HTTP_URL.match(value):
            raise ValueError("must be an absolute http(s) URL without user info")
        # RFC 6749 §3.1, §3.2: codes, tokens and the client secret travel only over TLS
        if value.startswith("http://") and not _is_loopback(value):
            raise ValueError("must use https (http is allowed only for loopback hosts)")
        return value

    @field_validator("scopes")
    @classmethod
    def _oidc_asks_for_openid(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        """Without `openid` an OpenID provider returns no ID token, and every exchange fails."""
        if info.data.get("kind") != "oidc":
            return value
        if not value:
            return ("openid",)
        if "openid" not in value:
            raise ValueError("an oidc provider must ask for the openid scope")
        return value

    @model_validator(mode="after")
    def _single_scopes(self) -> OAuthProviderSettings:
        for scope in self.scopes:
            if not is_scope_token(scope, self.scope_separator):
                raise ValueError(
                    f"scopes: {scope!r} is not a single scope (one scope per list entry, without "
                    "spaces, commas or the scope_separator)"
                )
        return self

    @model_validator(mode="after")
    def _oidc_needs_issuer(self) -> OAuthProviderSettings:
        if self.kind == "oidc" and not self.issuer:
            raise ValueError("an oidc provider needs issuer")
        if self.kind == "oauth2" and not (self.authorize_url and self.token_url):
            raise ValueError("an oauth2 provider needs authorize_url and token_url")
        return self

    @property
    def revokes(self) -> bool:
        return self.revocation == "github" or (
            self.revocation == "rfc7009" and self.revocation_url is not None
        )

    @property
    def revokes_one_token(self) -> bool:
        """The provider can revoke one token and leave the user's other grants alone (GitHub's
        `/token`). Not RFC 7009 in general: at some providers (Google) revoking any token of a
        user's grant ends the grant, a new token of the same account with it."""
        return self.revocation == "github"


ProviderSettings = Annotated[
    ApiKeyProviderSettings | OAuthProviderSettings, Field(discriminator="kind")
]
provider_settings_adapter: TypeAdapter[ProviderSettings] = TypeAdapter(ProviderSettings)
