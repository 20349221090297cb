-- A user's tasks of one status, newest first: the history page's (and GET /api/v1/tasks?status=)
-- filter reads a page without scanning the user's other tasks.
CREATE INDEX tasks_by_user_status_newest ON tasks (user_id, status, submitted_at DESC, task_id DESC);
