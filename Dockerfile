# Connect Broker: one process serving the MCP endpoint, the connect pages and the integration API.
# The base image is pinned by tag and by the digest of its multi-platform index, so a rebuild gets
# the same bytes. To move to a newer build, take the digest the registry publishes for the tag:
#   docker buildx imagetools inspect python:3.11.14-slim-bookworm   (the "Digest:" line)
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY templates ./templates
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# /srv/data: where the default SQLite database (sqlite:///./data/broker.db) is created
RUN useradd --system --uid 10001 --home-dir /srv broker \
    && install -d -o broker -g broker -m 0700 /srv/data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER broker
WORKDIR /srv
ENV BROKER_CONFIG=/etc/connect-broker/broker.toml
EXPOSE 8000
# Liveness: /healthz answers while the process serves, whatever the database does (a restart would
# not bring the database back). /readyz also checks the database and is for load balancers.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz').status != 200)"
CMD ["connect-broker", "serve", "--host", "0.0.0.0", "--port", "8000"]
