# Connect Broker: one process serving the MCP endpoint, the connect pages and the integration API.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY templates ./templates
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# /srv/data: where the default SQLite database (sqlite:///./data/broker.db) is created
RUN useradd --system --uid 10001 --home-dir /srv broker \
    && install -d -o broker -g broker -m 0700 /srv/data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER broker
WORKDIR /srv
ENV BROKER_CONFIG=/etc/connect-broker/broker.toml
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz').status != 200)"
CMD ["connect-broker", "serve", "--host", "0.0.0.0", "--port", "8000"]
