FROM python:3.11-slim
# gcc, pkg-config and libssl-dev build python-qpid-proton from its sdist (no Linux wheel).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc pkg-config libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY protocols ./protocols
RUN pip install --no-cache-dir .
EXPOSE 1883 5672 8080
CMD ["gateway", "serve", "--host", "0.0.0.0"]
