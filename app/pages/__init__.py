"""The browser surface: sign-in, connect links, the OAuth callback and the connections list.

Like `/mcp` and `/api/v1`, these routes only translate: the decisions live in `app/connect/`.
"""
