-- floodgate: fixed window.
-- At most `limit` units in each window aligned to multiples of `window`.
-- Key: a hash {s = window start (ms), c = units counted in it}; it expires
-- when its window ends. A key left from an earlier window reads as empty.
local fixed_window = {}

function fixed_window.check(key, limit, window, now, cost)
  local start = now - (now % window)
  local stored = redis.call('HMGET', key, 's', 'c')
  local count = 0
  if tonumber(stored[1]) == start then
    count = tonumber(stored[2]) or 0
  end
  local reset = start + window - now
  if count + cost <= limit then
    return {1, limit - count - cost, reset, 0}, count
  end
  return {0, limit - count, reset, reset}, count
end

function fixed_window.commit(key, limit, window, now, cost, count)
  local start = now - (now % window)
  redis.call('HSET', key, 's', int(start), 'c', int(count + cost))
  expire(key, start + window - now)
end
