/**
 * The one call the frontend makes: GET /stepwise/sessions on the Jupyter server (token, XSRF and
 * base URL handled by ServerConnection). Errors carry the server's message.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IReport } from './types';

export async function fetchReport(
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<IReport> {
  const url = URLExt.join(settings.baseUrl, 'stepwise', 'sessions');
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, {}, settings);
  } catch (error) {
    throw new Error(`the Jupyter server did not answer: ${error}`);
  }
  const text = await response.text();
  if (!response.ok) {
    throw new Error(
      response.status === 404
        ? 'the Stepwise server extension is not enabled: run `jupyter server extension enable workbench.lab` and restart JupyterLab'
        : `GET /stepwise/sessions answered ${response.status}: ${text.slice(0, 200)}`
    );
  }
  return JSON.parse(text) as IReport;
}
