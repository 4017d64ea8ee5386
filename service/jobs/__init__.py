"""Offline mode: images queued in RabbitMQ, classified by batching workers, results published back."""
