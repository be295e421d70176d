-- floodgate: sliding window counter.
-- The current aligned window's count plus the previous window's count
-- weighted by how much of it the trailing window still covers:
--   previous × (window − elapsed) / window + current + cost ≤ limit,
-- compared in whole unit-milliseconds so no rounding can admit extra units.
-- Key: a hash {s = current window start, c = its count, p = previous count};
-- it expires when the current window stops mattering (two windows after s).
local sliding_window = {}

-- The counts as seen from the window that `now` is in.
local function windows(key, window, now)
  local start = now - (now % window)
  local stored = redis.call('HMGET', key, 's', 'c', 'p')
  local s, c, p = tonumber(stored[1]), tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
  if s == start then
    return start, c, p
  elseif s == start - window then
    return start, 0, c
  end
  return start, 0, 0
end

function sliding_window.check(key, limit, window, now, cost)
  local start, cur, prev = windows(key, window, now)
  local elapsed = now - start
  local weighted = prev * (window - elapsed)
  local allowed = weighted + (cur + cost) * window <= limit * window
  local used = ceil_div(weighted, window) + cur
  if allowed then
    used = used + cost
  end
  local remaining = math.max(limit - used, 0)
  local reset = 0
  if cur > 0 or allowed then
    reset = start + 2 * window - now
  elseif prev > 0 then
    reset = start + window - now
  end
  if allowed then
    return {1, remaining, reset, 0}, cur
  end
  local retry
  if cur + cost <= limit then
    -- Later in this window, once enough of the previous one has slid out.
    retry = (window - floor_div((limit - cost - cur) * window, prev)) - elapsed
  else
    -- Not before the next window, where this one's count is the previous.
    retry = (start + window - now) + (window - floor_div((limit - cost) * window, cur))
  end
  return {0, remaining, reset, retry}, cur
end

function sliding_window.commit(key, limit, window, now, cost, cur)
  local start, _, prev = windows(key, window, now)
  redis.call('HSET', key, 's', int(start), 'c', int(cur + cost), 'p', int(prev))
  expire(key, start + 2 * window - now)
end
