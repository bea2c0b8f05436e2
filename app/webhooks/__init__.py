"""Signed webhooks: lifecycle events (the rows of `audit_events`) posted to operators' URLs."""
