"""Where runs come in: the gRPC server, kernel-attested peers, who may connect."""
