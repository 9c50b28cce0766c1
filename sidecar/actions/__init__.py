"""What a verdict leads to: the policy, pages, STOP, the signal escalation, alert links."""
