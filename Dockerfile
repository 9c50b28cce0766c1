# The deadweight sidecar: gRPC on a unix socket, Prometheus metrics over HTTP.
# It installs only the package's base dependencies; torch and TRL (the `train` extra) belong
# to the training image, never here.
#
#   docker build -t deadweight:0.1.0 .
#   behind a TLS-intercepting proxy:  --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
# The sidecar and the wire layer only: the training side (callbacks/) and the demo stay out of
# the image, and so do their links in deadweight/.
COPY deadweight ./deadweight
COPY sidecar ./sidecar
COPY proto ./proto
RUN --mount=type=secret,id=pip_cert \
    rm -f deadweight/callbacks deadweight/demo \
    && if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && python3 -m venv /opt/deadweight \
    && /opt/deadweight/bin/pip install --no-cache-dir /src

FROM python:3.11-slim
LABEL org.opencontainers.image.title="deadweight" \
      org.opencontainers.image.description="Sidecar that catches fine-tuning runs whose weights do not move" \
      org.opencontainers.image.source="https://github.com/deadweight/deadweight" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/deadweight /opt/deadweight
# A kill policy signals a trainer of another uid only with CAP_KILL (Kubernetes: add KILL).
# A non-root container receives an added capability in its bounding set only, so the
# interpreter the entry point runs becomes a copy carrying cap_kill as a permitted file
# capability (no effective bit: the image still starts where KILL is not granted); the
# sidecar raises it at start (sidecar/actions/signal_capability.py).
RUN /opt/deadweight/bin/python -m deadweight.sidecar.actions.signal_capability /opt/deadweight/bin/deadweight
RUN groupadd --system --gid 10001 deadweight \
    && useradd --system --uid 10001 --gid deadweight --no-create-home \
        --home-dir /var/lib/deadweight --shell /usr/sbin/nologin deadweight \
    && install -d -o deadweight -g deadweight -m 0770 /run/deadweight /var/lib/deadweight
ENV PATH=/opt/deadweight/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/deadweight
VOLUME ["/run/deadweight", "/var/lib/deadweight"]
EXPOSE 9464
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:9464/metrics', timeout=4)"]
# Extra flags given to `docker run IMAGE ...` are appended (e.g. --policy frozen_weights=stop).
ENTRYPOINT ["deadweight", "serve", "--socket", "/run/deadweight/deadweight.sock", \
            "--metrics-address", "0.0.0.0:9464", "--state-dir", "/var/lib/deadweight"]
