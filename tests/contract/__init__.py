"""What ships stays true: generated files, alert rules, manifests, the wire schema, the import layers, the wheel."""
