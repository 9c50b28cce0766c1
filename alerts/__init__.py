"""Alert rules, their tests, the Alertmanager example and the runbooks; all but the runbooks
are generated from the detectors' specs by ``python -m alerts.generate``."""
