"""AMQP 1.0 adapter: proton's engine driven from asyncio, SASL in Python, links on flows."""
