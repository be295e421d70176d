//! Redis for tests (filled in with the Redis store).
