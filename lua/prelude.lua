-- floodgate: shared helpers for the decision script.
--
-- The files in lua/ are joined into one script, in this order: prelude.lua,
-- one file per algorithm, decide.lua. Each algorithm file defines a table
-- with two functions that follow one convention:
--
--   check(key, limit, window, now, cost, burst) -> verdict, state
--     Whether `cost` units fit in the limit stored at `key` at time `now`
--     (milliseconds). It may tidy the key (drop expired entries) but never
--     consumes. `verdict` is {allowed (1/0), remaining, reset_ms,
--     retry_after_ms}; `state` is passed back to commit.
--   commit(key, limit, window, now, cost, state, burst)
--     Takes the units, and sets the key's TTL in the same call.
--
-- decide.lua calls every limit's check, then every commit only if all
-- allowed, so a route's limits decide all or nothing in one round trip.
-- The pure Rust twins in src/limit/algorithms.rs follow the same steps.

-- Whole numbers as Redis arguments, never in exponent notation.
local function int(n)
  return string.format('%d', n)
end

-- Keys outlive the moment their state stops mattering by this much. A late
-- expiry changes no decision (every algorithm reads a stale key as the empty
-- one it stands for), while an early one would: Redis expires keys by its
-- own clock, which can differ from the decision's `now` (a promoted replica,
-- or a test passing `now`).
local EXPIRY_SLACK_MS = 1000

-- Sets `key` to expire `ms` from now (plus the slack).
local function expire(key, ms)
  redis.call('PEXPIRE', key, int(math.max(ms, 0) + EXPIRY_SLACK_MS))
end

-- floor(a / b) for non-negative integers, exact even where the division of
-- two doubles would round up to the next whole number.
local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- ceil(a / b) for non-negative integers.
local function ceil_div(a, b)
  return floor_div(a + b - 1, b)
end
