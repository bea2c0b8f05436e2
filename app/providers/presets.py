"""Built-in OAuth provider presets: endpoints, default scopes, account label, quirks.

A `[providers.<name>]` table with `preset = "github"` (etc.) starts from these values; every key
given in the table overrides the preset's (tests point the endpoints at local servers).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

PRESETS: dict[str, dict[str, Any]] = {
    "github": {
        "kind": "oauth2",
        "display_name": "GitHub",
        "authorize_url": "https://github.com/login/oauth/authorize",
        "token_url": "https://github.com/login/oauth/access_token",
        "userinfo_url": "https://api.github.com/user",
        "api_base_url": "https://api.github.com",
        "revocation": "github",  # DELETE /applications/{client_id}/grant, not RFC 7009
        "scopes": ["read:user"],
        "scope_separator": ",",
        "account_label_claim": "login",
        "account_label_prefix": "@",
        "account_id_claim": "id",
    },
    "gitlab": {
        "kind": "oauth2",
        "display_name": "GitLab",
        "authorize_url": "https://gitlab.com/oauth/authorize",
        "token_url": "https://gitlab.com/oauth/token",
        "userinfo_url": "https://gitlab.com/api/v4/user",
        "revocation_url": "https://gitlab.com/oauth/revoke",
        "scopes": ["read_user"],
        "account_label_claim": "username",
        "account_label_prefix": "@",
        "account_id_claim": "id",
    },
    "google": {
        "kind": "oidc",
        "display_name": "Google",
        "issuer": "https://accounts.google.com",
        "authorize_url": "https://accounts.google.com/o/oauth2/v2/auth",
        "token_url": "https://oauth2.googleapis.com/token",
        "userinfo_url": "https://openidconnect.googleapis.com/v1/userinfo",
        "revocation_url": "https://oauth2.googleapis.com/revoke",
        "scopes": ["openid", "email"],
        "account_label_claim": "email",
        "account_id_claim": "sub",
        "authorize_params": {"access_type": "offline", "prompt": "consent"},
    },
    "slack": {
        "kind": "oauth2",
        "display_name": "Slack",
        "authorize_url": "https://slack.com/oauth/v2/authorize",
        "token_url": "https://slack.com/api/oauth.v2.access",
        "revocation_url": "https://slack.com/api/auth.revoke",
        # the user's own token (`user_scope`, answered under `authed_user`), not the app's bot
        "scopes": ["users:read"],
        "scope_separator": ",",
        "scope_parameter": "user_scope",
        "token_member": "authed_user",
        "token_types": ["user"],
        "account_label_claim": "team.name",
    },
    "microsoft": {
        "kind": "oauth2",
        "display_name": "Microsoft",
        "authorize_url": "https://login.microsoftonline.com/common/oauth2/v2.0/authorize",
        "token_url": "https://login.microsoftonline.com/common/oauth2/v2.0/token",
        "userinfo_url": "https://graph.microsoft.com/oidc/userinfo",
        # userinfo carries `email` (the account label) only when the email scope was granted
        "scopes": ["openid", "profile", "email", "offline_access", "User.Read"],
        "account_label_claim": "email",
        "account_id_claim": "sub",
    },
    "atlassian": {
        "kind": "oauth2",
        "display_name": "Atlassian",
        "authorize_url": "https://auth.atlassian.com/authorize",
        "token_url": "https://auth.atlassian.com/oauth/token",
        "userinfo_url": "https://api.atlassian.com/me",
        "scopes": ["read:me", "offline_access"],
        "account_label_claim": "email",
        "account_id_claim": "account_id",
        "authorize_params": {"audience": "api.atlassian.com", "prompt": "consent"},
    },
    "linear": {
        "kind": "oauth2",
        "display_name": "Linear",
        "authorize_url": "https://linear.app/oauth/authorize",
        "token_url": "https://api.linear.app/oauth/token",
        "revocation_url": "https://api.linear.app/oauth/revoke",
        "scopes": ["read"],
        "scope_separator": ",",
    },
    "notion": {
        "kind": "oauth2",
        "display_name": "Notion",
        "authorize_url": "https://api.notion.com/v1/oauth/authorize",
        "token_url": "https://api.notion.com/v1/oauth/token",
        "client_auth_method": "client_secret_basic",  # its token endpoint wants HTTP Basic
        "scopes": [],
        "account_label_claim": "workspace_name",  # read from the token response
        "authorize_params": {"owner": "user"},
    },
}


def apply_preset(values: dict[str, Any]) -> dict[str, Any]:
    """The table's values over the named preset's.

    Raises:
        ValidationError: an unknown preset name, located at `preset` (checked here, before the
            missing `kind` or `display_name` a preset would have supplied hides it).
    """
    if "preset" not in values:
        return values
    preset = PRESETS.get(values["preset"]) if isinstance(values["preset"], str) else None
    if preset is None:
        *others, last = (repr(name) for name in PRESETS)
        raise ValidationError.from_exception_data(
            "preset",
            [
                {
                    "type": "literal_error",
                    "loc": ("preset",),
                    "input": values["preset"],
                    "ctx": {"expected": f"{', '.join(others)} or {last}"},
                }
            ],
        )
    return {**preset, **values}
