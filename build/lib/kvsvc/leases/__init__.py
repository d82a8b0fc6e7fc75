"""Layer 5: P-side leases (publish, claim, release accounting, expiry) with epochs."""
