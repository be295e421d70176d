-- floodgate: generic cell rate algorithm.
-- One unit per emission interval `window / limit`, with bursts of up to
-- `burst` units. The theoretical arrival time (TAT) is kept as whole
-- milliseconds plus a fraction in 1/`limit` ms, so the interval is exact
-- even when `limit` does not divide `window` (no float drift, no epoch
-- rebasing: only TAT − now is ever scaled, and it stays small).
-- Key: a hash {m = TAT whole ms, f = TAT fraction}; it expires at the TAT,
-- after which a missing key means the same as the old one: no backlog.
local gcra = {}

-- How far the TAT is ahead of now, in 1/limit ms.
local function ahead(key, limit, now)
  local stored = redis.call('HMGET', key, 'm', 'f')
  local tat_ms, tat_frac = tonumber(stored[1]), tonumber(stored[2]) or 0
  if not tat_ms or tat_ms < now then
    return 0
  end
  return (tat_ms - now) * limit + tat_frac
end

function gcra.check(key, limit, window, now, cost, burst)
  local tolerance = window * burst
  local before = ahead(key, limit, now)
  local after = before + window * cost
  if after <= tolerance then
    return {1, floor_div(tolerance - after, window), ceil_div(after, limit), 0}, after
  end
  return {0, floor_div(tolerance - before, window), ceil_div(before, limit),
    ceil_div(after - tolerance, limit)}, after
end

function gcra.commit(key, limit, window, now, cost, after)
  local whole = floor_div(after, limit)
  redis.call('HSET', key, 'm', int(now + whole), 'f', int(after - whole * limit))
  expire(key, ceil_div(after, limit))
end
