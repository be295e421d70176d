-- floodgate: shared helpers for the decision script.
--
-- The files in lua/ are joined into one script, in this order: prelude.lua,
-- one file per algorithm, decide.lua. Each algorithm file defines a table
-- with two functions that follow one convention:
--
--   check(key, limit, window, now, cost) -> verdict, state
--     Whether `cost` units fit in the limit stored at `key` at time `now`
--     (milliseconds). It may tidy the key (drop expired entries) but never
--     consumes. `verdict` is {allowed (1/0), remaining, reset_ms,
--     retry_after_ms}; `state` is passed back to commit.
--   commit(key, limit, window, now, cost, state)
--     Takes the units, and sets the key's TTL in the same call.
--
-- decide.lua calls every limit's check, then every commit only if all
-- allowed, so a route's limits decide all or nothing in one round trip.
-- The pure Rust twins in src/limit/algorithms.rs follow the same steps.

-- Whole numbers as Redis arguments, never in exponent notation.
local function int(n)
  return string.format('%d', n)
end
