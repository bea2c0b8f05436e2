"""Built-in OAuth provider presets: endpoints, default scopes, account label, quirks.

A `[providers.<name>]` table with `preset = "github"` (etc.) starts from these values; every key
given in the table overrides the preset's (tests point the endpoints at local servers).
"""

from __future__ import annotations

from typing import Any

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
        "authorize_params": {"access_type": "offline", "prompt": "consent"},
    },
    "slack": {
        "kind": "oauth2",
        "display_name": "Slack",
        "authorize_url": "https://slack.com/oauth/v2/authorize",
        "token_url": "https://slack.com/api/oauth.v2.access",
        "revocation_url": "https://slack.com/api/auth.revoke",
        "scopes": ["users:read"],
        "scope_separator": ",",
        "account_label_claim": "team.name",
    },
    "microsoft": {
        "kind": "oauth2",
        "display_name": "Microsoft",
        "authorize_url": "https://login.microsoftonline.com/common/oauth2/v2.0/authorize",
        "token_url": "https://login.microsoftonline.com/common/oauth2/v2.0/token",
        "userinfo_url": "https://graph.microsoft.com/oidc/userinfo",
        "scopes": ["openid", "profile", "offline_access", "User.Read"],
        "account_label_claim": "email",
    },
    "atlassian": {
        "kind": "oauth2",
        "display_name": "Atlassian",
        "authorize_url": "https://auth.atlassian.com/authorize",
        "token_url": "https://auth.atlassian.com/oauth/token",
        "userinfo_url": "https://api.atlassian.com/me",
        "scopes": ["read:me", "offline_access"],
        "account_label_claim": "email",
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
        "scopes": [],
        "account_label_claim": "workspace_name",  # read from the token response
        "authorize_params": {"owner": "user"},
    },
}


def apply_preset(values: dict[str, Any]) -> dict[str, Any]:
    """The table's values over the named preset's (unknown preset names are left to validation)."""
    preset = PRESETS.get(str(values.get("preset")))
    if preset is None:
        return values
    return {**preset, **values}
