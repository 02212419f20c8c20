-- reset.lua: clears a subject: deletes its keys (one per limit), so its
-- next request finds it idle. Bookings already handed out keep their
-- slots on the callers' side; the limit starts afresh from the reset.
--
-- KEYS  the subject's keys
-- Returns the number of keys deleted.
return redis.call('DEL', unpack(KEYS))
