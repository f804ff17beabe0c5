-- Replace a produced file's unrendered outcomes with its rendered content, once (the API renders
-- a batch's output and error files on first read; two readers may race, and either's bytes are
-- the same). Nothing is written to a file deleted meanwhile: the hash is not brought back.
-- KEYS[1] file hash   ARGV[1] meta (JSON, with the rendered size)   ARGV[2] content
-- Returns 1 when stored, 0 when the file is gone or was rendered already.
if redis.call('HEXISTS', KEYS[1], 'outcomes') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'meta', ARGV[1], 'content', ARGV[2])
redis.call('HDEL', KEYS[1], 'outcomes')
return 1
