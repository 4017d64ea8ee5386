"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``, as Triton serves it),
in the HTTP server's process and over its models: ``tritonclient.grpc`` and ``perf_analyzer`` talk
to the gateway as they talk to Triton. The protos are the ones ``tritonclient`` ships."""
