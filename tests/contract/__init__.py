"""What ships stays true: generated files, rules, manifests, wire schema, import layers, wheel."""
