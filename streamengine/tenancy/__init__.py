"""Tenants: their records, fair-share accounting, pinned prefixes."""
