-- floodgate: sliding log.
-- At most `limit` units in any trailing `window`, exactly.
-- Key: a sorted set with one member per admitted unit, scored by the time
-- it was admitted. Members are "<time>:<n>" with n counting the members
-- already at that time, so two units in the same millisecond are two
-- members. An entry admitted at t counts while now < t + window. The key
-- expires one window after its newest entry.
local function sliding_log()
  -- Reads the score of the member at `rank` (negative counts from the end).
  local function score_at(key, rank)
    local hit = redis_call('ZRANGE', key, rank, rank, 'WITHSCORES')
    return tonumber(hit[2])
  end

  local function check(key, limit, window, now, cost)
    redis_call('ZREMRANGEBYSCORE', key, '-inf', int(now - window))
    local total = redis_call('ZCARD', key)
    if total + cost <= limit then
      local left = limit - total - cost
      local more = 0
      if left == 0 then
        -- The next unit is free when the oldest leaves (this request's
        -- own, when it is the only one).
        more = window
        if total > 0 then
          more = score_at(key, 0) + window - now
        end
      end
      return 1, left, more, 0
    end
    -- Wait until enough of the oldest units have left the window.
    local excess = total + cost - limit
    local retry = score_at(key, excess - 1) + window - now
    return 0, limit - total, retry, retry
  end

  local function commit(key, limit, window, now, cost)
    -- Keep scores ordered even if Redis's clock stepped back.
    local t = now
    local newest = score_at(key, -1)
    if newest and newest > t then
      t = newest
    end
    local seq = redis_call('ZCOUNT', key, int(t), int(t))
    local args = {}
    for i = 1, cost do
      args[#args + 1] = int(t)
      args[#args + 1] = int(t) .. ':' .. int(seq + i)
      if #args >= 1000 or i == cost then
        redis_call('ZADD', key, unpack(args))
        args = {}
      end
    end
    redis_call('PEXPIRE', key, int(t + window - now + EXPIRY_SLACK_MS))
  end

  return check, commit
end
