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
    -- The next unit is free when the oldest counted leaves (this
    -- request's own, when it is the first); nothing is to come back to
    -- an empty log that this request leaves empty.
    local more = 0
    if total > 0 then
      more = score_at(key, 0) + window - now
    elseif cost > 0 and cost <= limit then
      more = window
    end
    if total + cost <= limit then
      return 1, limit - total - cost, more, 0
    end
    -- This request waits until enough of the oldest units have left.
    -- One larger than the limit never fits: it is told a whole window.
    local excess = total + cost - limit
    local retry = window
    if excess <= total then
      retry = score_at(key, excess - 1) + window - now
    end
    return 0, limit - total, more, retry
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

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms/sliding_log.rs, settle): more units are logged now; unused ones
  -- leave the log while its entry is still in the window. The members at
  -- `at` are "<at>:1" … "<at>:k"; the highest go, so the next commit's
  -- numbering (ZCOUNT + 1 onwards) never meets a member still there.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    if used > reserved then
      return commit(key, limit, window, now, used - reserved)
    end
    if used == reserved or at + window <= now then
      return
    end
    local k = redis_call('ZCOUNT', key, int(at), int(at))
    local n = min(reserved - used, k)
    local members = {}
    for i = 0, n - 1 do
      members[#members + 1] = int(at) .. ':' .. int(k - i)
      if #members >= 500 or i == n - 1 then
        redis_call('ZREM', key, unpack(members))
        members = {}
      end
    end
  end

  return check, commit, settle
end
