-- floodgate: fixed window.
-- At most `limit` units in each window aligned to multiples of `window`.
-- Key: "<window start> <units counted in it>"; it expires when its window
-- ends. A key left from an earlier window reads as empty.
local function fixed_window()
  local function check(key, limit, window, now, cost)
    local start = now - (now % window)
    local s, c = load(key)
    local count = 0
    if s == start then
      count = c
    end
    local reset = start + window - now
    if count + cost <= limit then
      return 1, limit - count - cost, reset, 0, count
    end
    return 0, limit - count, reset, reset, count
  end

  local function commit(key, limit, window, now, cost, burst, count)
    local start = now - (now % window)
    save(key, start + window - now, start, count + cost)
  end

  return check, commit
end
